"""Many clients at once, and clients that go away: on the tiny model, prefix caching off,
8 sequences at a time (so 64 clients queue)."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest
import requests

from quire import LLM, SamplingParams

from server_harness import metric, metrics_of, server, tiny_model, wait_idle

NUM_CLIENTS = 64
MAX_TOKENS = 16
LONG = 900  # tokens no test waits for: such requests end only by being aborted
SLOW = "__slow__ "  # fault_launcher.py: such requests take >= 50 ms a token on any machine


@pytest.fixture(scope="module")
def srv():
    return server("tiny")


def _words(seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["river", "stone", "light", "market", "seven", "quiet", "engine", "cloud", "paper",
             "north", "garden", "copper", "signal", "winter", "orange", "thread"]
    return " ".join(rng.choice(vocab) for _ in range(rng.randrange(1, 40)))


async def _stream_completion(client: httpx.AsyncClient, url: str, prompt: str) -> tuple:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text, chunks, finish = "", 0, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            assert "choices" in payload, payload  # an error event instead of a chunk
            choice = payload["choices"][0]
            text += choice["text"]
            chunks += 1
            finish = choice["finish_reason"] or finish
    return text, chunks, finish


class MetricsWatcher(threading.Thread):
    """Scrapes /metrics every 50 ms and keeps the highest gauges seen."""

    def __init__(self, srv) -> None:
        super().__init__(daemon=True)
        self.srv, self.stop, self.peak = srv, threading.Event(), {}

    def run(self) -> None:
        while not self.stop.is_set():
            samples = metrics_of(self.srv)
            for name in ("quire:num_requests_waiting", "quire:num_requests_running",
                         "quire:kv_cache_usage_perc", "quire:kv_cache_blocks_used"):
                self.peak[name] = max(self.peak.get(name, 0.0), metric(samples, name))
            self.stop.wait(0.05)


def test_64_concurrent_streams_match_sequential_greedy(srv):
    # slow on the server (>= 50 ms a step on any machine), so the 50 ms scrapes cannot miss
    # the queue however fast the machine; the reference sees the same prompts
    prompts = [SLOW + _words(i) for i in range(NUM_CLIENTS)]
    llm = LLM(tiny_model(), dtype="float32", kv_cache_memory=16 << 20, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in prompts]
    del llm

    watcher = MetricsWatcher(srv)
    watcher.start()

    async def run_all():
        limits = httpx.Limits(max_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(headers=srv.headers, timeout=300, limits=limits) as c:
            return await asyncio.gather(*(_stream_completion(c, srv.url, p) for p in prompts))

    try:
        results = asyncio.run(run_all())
    finally:
        watcher.stop.set()
        watcher.join()
    mismatches = [(i, got, want) for i, ((got, _, _), want) in
                  enumerate(zip(results, expected)) if got != want]
    assert not mismatches, mismatches[:3]
    assert all(finish in ("length", "stop") for _, _, finish in results)
    assert sum(chunks for _, chunks, _ in results) > NUM_CLIENTS * 2  # really streamed

    # under load the gauges rose ...
    assert watcher.peak["quire:num_requests_waiting"] > 0
    assert watcher.peak["quire:num_requests_running"] == 8  # --max-num-seqs
    assert watcher.peak["quire:kv_cache_usage_perc"] > 0
    # ... and fall back once it is over
    samples = metrics_of(srv)
    for name in ("quire:num_requests_waiting", "quire:num_requests_running",
                 "quire:kv_cache_usage_perc", "quire:kv_cache_blocks_used"):
        assert metric(samples, name) == 0, name


def test_disconnected_clients_are_aborted_and_blocks_freed(srv):
    aborted_before = metric(metrics_of(srv), "quire:request_success_total",
                            finished_reason="abort")
    # streaming clients read a little, then hang up
    body = {"prompt": SLOW + "one two three", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    responses = []
    for _ in range(6):
        r = requests.post(srv.url + "/v1/completions", json=body, headers=srv.headers,
                          stream=True, timeout=60)
        assert r.status_code == 200
        responses.append(r)
    # (keep the line iterators: dropping one lets urllib3 close its connection early)
    readers = [r.iter_lines() for r in responses]
    for lines in readers:
        assert [next(lines) for _ in range(4)]  # two events arrived
    samples = metrics_of(srv)
    assert metric(samples, "quire:num_requests_running") == 6
    assert metric(samples, "quire:kv_cache_blocks_used") > 0
    for r in responses:
        r.close()
    # a non-streaming client that gives up waiting
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(srv.url + "/generate", headers=srv.headers, timeout=1.0,
                      json={"prompt": SLOW + "four five", "max_tokens": LONG,
                            "ignore_eos": True})

    # (on a loaded machine the server may read the seventh request after the client left:
    # idle is not enough, its abort must be counted too)
    samples = wait_idle(srv, until=lambda s: metric(s, "quire:request_success_total",
                                                    finished_reason="abort") >= aborted_before + 7)
    assert metric(samples, "quire:num_requests_running") == 0
    assert metric(samples, "quire:num_requests_waiting") == 0
    assert metric(samples, "quire:kv_cache_blocks_used") == 0
    assert metric(samples, "quire:request_success_total",
                  finished_reason="abort") == aborted_before + 7
    assert metric(samples, "quire:client_disconnects_total") >= 7
