"""`--routing precise-prefix` in front of two real `quire serve` replicas that publish their
KV-cache events to the router: after a replica evicted a prefix and the other one got it by
another path, the events-driven router sends the prompt where its blocks really are (a full
prefix hit), while today's history-based prefix-aware router sends it to the replica it
remembers (a miss)."""

from __future__ import annotations

import json
import random
import sys
import time

import pytest
import requests

from router_harness import InProcessRouter, Proc, free_port, server_harness, wait_until

BLOCK = 16
POOL = str(32 * 6144)  # the tiny model: the server keeps 16 blocks of 16 tokens


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


PROMPT = _prompt(11, 200)
FILLERS = [_prompt(300 + i, 220) for i in range(3)]


@pytest.fixture(scope="module")
def setup():
    tiny = server_harness().tiny_model()
    events_port = free_port("127.0.0.1")
    procs = []
    for name, host in (("a", "127.0.0.41"), ("b", "127.0.0.42")):
        port = free_port(host)
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{events_port}", "topic": f"kv@{host}:{port}@tiny"}
        procs.append(Proc(f"serve-{name}", [
            sys.executable, "-m", "quire.entrypoints.cli", "serve", tiny, "--dtype", "float32",
            "--kv-cache-memory", POOL, "--num-threads", "1", "--kv-events-config",
            json.dumps(config), "--host", host, "--port", str(port)], host, port, "/ready"))
    try:
        for p in procs:
            p.launch()
        for p in procs:
            p.wait_ready(300)
        yield tiny, procs, events_port
    finally:
        for p in procs:
            p.stop()


def _complete(url: str, prompt: list[int]) -> int:
    r = requests.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2,
                                                     "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _prompt_tokens(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("quire:prompt_tokens_total"))


def test_events_beat_history_after_evictions(setup):
    tiny, (a, b), events_port = setup
    common = ["--model", tiny, "--block-size", str(BLOCK), f"--backend={a.url}",
              f"--backend={b.url}"]
    with InProcessRouter("--routing", "prefix-aware", *common) as history, \
            InProcessRouter("--routing", "precise-prefix", "--kv-events-bind",
                            f"tcp://127.0.0.1:{events_port}", *common) as precise:
        time.sleep(1.0)  # the replicas' publishers reconnect to the router's socket
        before = {p.url: _prompt_tokens(p.url) for p in (a, b)}
        assert _complete(history.url, PROMPT) == 0
        holder = next(p for p in (a, b) if _prompt_tokens(p.url) > before[p.url])
        other = b if holder is a else a
        # the holder evicts the prompt (other clients' traffic); the other replica gets it
        for f in FILLERS:
            _complete(holder.url, f)
        assert _complete(other.url, PROMPT) == 0
        full = (len(PROMPT) - 1) // BLOCK * BLOCK

        def indexed():
            state = requests.get(precise.url + "/router/state", timeout=5).json()
            return state["kv_events"]["blocks"] >= full // BLOCK
        wait_until(indexed, 30, "the router to index the replicas' events")
        time.sleep(0.5)  # and the evictions' events after them

        history_hit = _complete(history.url, PROMPT)   # goes to the replica it remembers
        precise_hit = _complete(precise.url, PROMPT)   # goes to where the blocks are
        assert history_hit == 0
        assert precise_hit >= 0.9 * full
