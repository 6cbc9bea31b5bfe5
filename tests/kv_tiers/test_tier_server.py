"""Two `quire serve` replicas sharing one real redis-server: a prefix prefilled on one is a hit
on the other (usage.prompt_tokens_details.cached_tokens), a prefix evicted from a replica's
pool comes back from its host tier, and /metrics counts the tiers' hits. Bad tier and events
settings stop `quire serve` at start-up: exit 2, one line naming the flag."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import requests
from tier_helpers import BLOCK_SIZE, prompt

from server_harness import ROOT, ServerProcess, metric, metrics_of, tiny_model

POOL = str(32 * 6144)  # bytes: the server keeps 16 blocks of the tiny model in it
PROMPT = prompt(5, 200)
FILLERS = [prompt(200 + i, 220) for i in range(3)]


def _complete(srv, p) -> dict:
    r = requests.post(srv.url + "/v1/completions",
                      json={"prompt": p, "max_tokens": 4, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def replicas(redis_server):
    servers = [ServerProcess(f"tiered-{i}", [
        tiny_model(), "--dtype", "float32", "--kv-cache-memory", POOL, "--num-threads", "1",
        "--kv-offloading-backend", "native", "--kv-offloading-size", "0.01",
        "--kv-offloading-remote", redis_server.url]) for i in range(2)]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(300)
        yield servers, redis_server
    finally:
        for s in servers:
            s.stop()


def test_replicas_share_prefixes_through_redis(replicas):
    (a, b), redis_server = replicas
    full = (len(PROMPT) - 1) // BLOCK_SIZE
    first = _complete(a, PROMPT)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    client = redis_server.client()
    deadline = time.monotonic() + 30
    while client.dbsize() < full:  # a's writer thread files the blocks off the step
        assert time.monotonic() < deadline, "replica a never stored its blocks in redis"
        time.sleep(0.05)
    on_b = _complete(b, PROMPT)
    assert on_b["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * full * BLOCK_SIZE
    assert on_b["choices"][0]["text"] == first["choices"][0]["text"]
    for f in FILLERS:  # a's pool forgets the prompt; its host tier does not
        _complete(a, f)
    again = _complete(a, PROMPT)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * full * BLOCK_SIZE
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert metric(metrics_of(b), "quire:kv_offload_hits_total", tier="remote") >= 0.9 * full
    assert metric(metrics_of(a), "quire:kv_offload_hits_total", tier="host") >= 0.9 * full
    assert metric(metrics_of(a), "quire:kv_offload_errors_total", tier="remote") == 0


@pytest.mark.parametrize("flags, flag", [
    (["--kv-offloading-size", "0"], "--kv-offloading-size"),
    (["--kv-offloading-size", "-2"], "--kv-offloading-size"),
    (["--kv-offloading-size", "lots"], "--kv-offloading-size"),
    (["--kv-offloading-disk-path", "/proc/quire-kv", "--kv-offloading-disk-size", "1"],
     "--kv-offloading-disk-path"),
    (["--kv-offloading-disk-size", "1"], "--kv-offloading-disk-path"),
    (["--kv-offloading-remote", "http://cache:6379"], "--kv-offloading-remote"),
    (["--kv-offloading-remote", "redis://cache:port"], "--kv-offloading-remote"),
    (["--kv-events-config", "{not json"], "--kv-events-config"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "colour": 1}'],
     "--kv-events-config"),
])
def test_bad_tier_settings_exit_2_naming_the_flag(flags, flag, capsys):
    from quire.entrypoints.cli import main
    try:
        code = main(["serve", "/nonexistent", *flags])
    except SystemExit as e:  # argparse's own refusals (a value that is not a number)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert flag in last, last
    assert "Traceback" not in err


def test_quire_serve_refuses_a_bad_remote_before_loading():
    done = subprocess.run([sys.executable, "-m", "quire.entrypoints.cli", "serve", tiny_model(),
                           "--kv-offloading-remote", "redis://"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("quire: error: --kv-offloading-remote:"), lines[-1]
    assert not any("loaded" in line for line in lines)  # refused before the model loaded
