"""Request migration (issue 50): the replica streaming a greedy request is SIGKILLed, or
drained by SIGTERM past its shutdown timeout, and the request goes on on another replica
with the tokens already streamed: the client gets one uninterrupted stream (one id, one usage
block, one [DONE]) whose tokens are transformers' greedy run and whose text is the
uninterrupted run's. A stream no replica is left to continue ends with a clear error event.
Live `quire serve` replicas of a tiny float32 Llama, stopped by PID by the test."""

from __future__ import annotations

import json
import signal
import threading

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from otlp_receiver import HttpReceiver
from router_harness import InProcessRouter as router
from router_harness import (
    fake_backend,
    quire_serve,
    router_state,
    server_harness,
    sse_texts,
    wait_until,
)
from router_harness import router as router_process

MAX_TOKENS = 400  # long enough (at a few hundred tokens a second) to be cut in the middle


@pytest.fixture(scope="module")
def tiny():
    return server_harness().tiny_model()


@pytest.fixture(scope="module")
def reference(tiny):
    """(prompt ids, transformers' greedy continuation)."""
    helpers = server_harness().runtime_helpers()
    prompt = helpers.random_prompts(1, lengths=[12], seed=50)[0]
    return prompt, helpers.hf_greedy(helpers.hf_model(tiny), [prompt], MAX_TOKENS)[0]


def replicas(tiny, names_hosts, *extra):
    procs = [quire_serve(name, host, tiny, "--dtype", "float32", "--kv-cache-memory", "16M",
                         "--num-threads", "1", *extra) for name, host in names_hosts]
    try:
        for p in procs:
            p.launch()
        for p in procs:
            p.wait_ready(300)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def streaming_replica(r, procs):
    """The replica (of `procs`) the router has the one open request on."""
    urls = {p.url for p in procs}
    busy = wait_until(lambda: [b["url"] for b in router_state(r)["backends"]
                               if b["in_flight"] == 1 and b["url"] in urls], 30,
                      "the request to be open")
    return next(p for p in procs if p.url == busy[0])


def wait_idle(r) -> None:
    """Until the router holds no request open. A migrated stream's [DONE] reaches the client
    before the router closes its two legs (the dead replica's and the continuation's), so the
    next request's replica is told apart only once those counts are back to 0."""
    wait_until(lambda: all(b["in_flight"] == 0 for b in router_state(r)["backends"]), 30,
               "the last request's legs to close")


def read_events(lines, until: int | None = None) -> list:
    """SSE events as JSON ("[DONE]" as the string) from one response's line iterator (read
    on where the last call stopped), up to `until` of them."""
    events = []
    for line in lines:
        if line.startswith(b"data: "):
            data = line[6:]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            if until is not None and len(events) >= until:
                break
    return events


def metric(r, name: str, **labels) -> float:
    text = requests.get(r.url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def check_one_stream(events: list, prompt_len: int, expected_ids: list[int], text_key) -> str:
    """One uninterrupted stream: the tokens, one id, one usage block, [DONE] once at the end."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e.get("choices")]
    usage = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert not any("error" in e for e in events[:-1])
    assert len({e["id"] for e in chunks}) == 1
    assert [t for e in chunks for t in e["choices"][0].get("token_ids", [])] == expected_ids
    assert usage == [{**usage[0], "prompt_tokens": prompt_len,
                      "completion_tokens": len(expected_ids),
                      "total_tokens": prompt_len + len(expected_ids)}]
    # the continuation's cache hits on the continued tokens are not the prompt's
    cached = (usage[0].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert 0 <= cached <= prompt_len
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(text_key(e["choices"][0]) or "" for e in chunks)


def test_sigkill_mid_request_streamed_and_whole_then_no_replica_left(tiny, reference):
    prompt, greedy = reference
    procs = replicas(tiny, [("a", "127.0.0.61"), ("b", "127.0.0.62"), ("c", "127.0.0.63")])
    try:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        # The uninterrupted run's text, straight from a replica.
        whole = requests.post(procs[0].url + "/v1/completions", json=body, timeout=300).json()
        text = whole["choices"][0]["text"]
        with router(*[f"--backend={p.url}" for p in procs], "--migration-limit", "2") as r:
            # Streamed: SIGKILL the replica after a few chunks.
            response = requests.post(r.url + "/v1/completions", stream=True, timeout=300, json={
                **body, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}})
            lines = response.iter_lines()
            events = read_events(lines, until=5)
            victim = streaming_replica(r, procs)
            victim.proc.send_signal(signal.SIGKILL)
            events += read_events(lines)
            victim.proc.wait(30)
            streamed = check_one_stream(events, len(prompt), greedy, lambda c: c.get("text"))
            assert streamed == text
            assert metric(r, "quire_router:migrations_total", reason="connection_lost") == 1

            # Whole: SIGKILL the replica while it computes; the request is sent again.
            wait_idle(r)
            answer = {}
            worker = threading.Thread(target=lambda: answer.update(r=requests.post(
                r.url + "/v1/completions", json=body, timeout=300)))
            worker.start()
            second = streaming_replica(r, [p for p in procs if p is not victim])
            second.proc.send_signal(signal.SIGKILL)
            worker.join(300)
            second.proc.wait(30)
            assert answer["r"].status_code == 200, answer["r"].text
            assert answer["r"].json()["choices"][0]["text"] == text
            assert answer["r"].json()["usage"]["completion_tokens"] == MAX_TOKENS

            # The last replica dies mid-stream: nowhere to go, a clear error event.
            wait_idle(r)
            last = next(p for p in procs if p not in (victim, second))
            response = requests.post(r.url + "/v1/completions", stream=True, timeout=300,
                                     json={**body, "stream": True})
            lines = response.iter_lines()
            events = read_events(lines, until=3)
            streaming_replica(r, [last])
            last.proc.send_signal(signal.SIGKILL)
            events += read_events(lines)
            assert "[DONE]" not in events
            error = events[-1]["error"]
            assert error["code"] == "upstream_failed"
            assert "no other replica could continue it" in error["message"]
            assert metric(r, "quire_router:migration_failures_total") == 1
    finally:
        for p in procs:
            p.stop()


def test_sigterm_drain_past_its_timeout_continues_elsewhere(tiny, reference):
    """A replica drained with a 0.25 s shutdown timeout aborts the request it still runs (the
    stream's finish_reason "abort"); the router continues the chat stream, and resends a
    whole request, on the other replica."""
    prompt, _ = reference
    procs = replicas(tiny, [("d", "127.0.0.64"), ("e", "127.0.0.65"), ("f", "127.0.0.66")],
                     "--shutdown-timeout", "0.25")
    try:
        messages = [{"role": "user", "content": "Tell me a very long story about the sea."}]
        chat = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        # The uninterrupted run, streamed straight from a replica: its tokens and text.
        direct = read_events(requests.post(procs[0].url + "/v1/chat/completions", json=chat,
                                           stream=True, timeout=300).iter_lines())
        chunks = [e for e in direct[:-1] if e.get("choices")]
        prompt_ids = next(c["choices"][0]["prompt_token_ids"] for c in chunks
                          if "prompt_token_ids" in c["choices"][0])  # (after the role chunk)
        ids = [t for e in chunks for t in e["choices"][0].get("token_ids", [])]
        helpers = server_harness().runtime_helpers()
        assert ids == helpers.hf_greedy(helpers.hf_model(tiny), [prompt_ids], MAX_TOKENS)[0]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
        with router(*[f"--backend={p.url}" for p in procs]) as r:
            response = requests.post(r.url + "/v1/chat/completions", json=chat, stream=True,
                                     timeout=300)
            lines = response.iter_lines()
            events = read_events(lines, until=5)
            victim = streaming_replica(r, procs)
            victim.proc.send_signal(signal.SIGTERM)
            events += read_events(lines)
            assert victim.proc.wait(60) == 0  # it drained and exited cleanly
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert sum(1 for e in events[:-1] if e.get("choices")
                       and e["choices"][0]["delta"].get("role")) == 1  # one opening
            streamed = check_one_stream(events, len(prompt_ids), ids,
                                        lambda c: c["delta"].get("content"))
            assert streamed == text
            assert metric(r, "quire_router:migrations_total", reason="aborted") == 1

            # Whole: the drained replica's aborted answer is not passed on; it is sent again.
            whole = {**chat, "stream": False, "return_token_ids": False}
            whole.pop("stream_options")
            wait_idle(r)
            answer = {}
            worker = threading.Thread(target=lambda: answer.update(r=requests.post(
                r.url + "/v1/chat/completions", json=whole, timeout=300)))
            worker.start()
            second = streaming_replica(r, [p for p in procs if p is not victim])
            # running there (not just sent: a drain refuses what it has not admitted, a 503)
            wait_until(lambda: metric(second, "quire:num_requests_running") == 1, 60,
                       "the replica to run it")
            second.proc.send_signal(signal.SIGTERM)
            worker.join(300)
            assert second.proc.wait(60) == 0
            assert answer["r"].status_code == 200, answer["r"].text
            assert answer["r"].json()["choices"][0]["message"]["content"] == text
            assert answer["r"].json()["choices"][0]["finish_reason"] == "length"
            assert metric(r, "quire_router:migrations_total", reason="aborted") == 2
    finally:
        for p in procs:
            p.stop()


def test_a_migration_is_counted_and_traced_on_the_routers_span():
    """Fake replicas (no model): the one that gets the stream dies after two chunks; the
    stream goes on on the other, and the migration is an event on the router's span."""
    with HttpReceiver() as receiver, fake_backend("x", "127.0.0.67", chunks=8) as x, \
            fake_backend("y", "127.0.0.68", chunks=8) as y:
        proc = router_process("--backend", x.url, "--backend", y.url,
                              "--otlp-traces-endpoint", receiver.url, host="127.0.0.69")
        proc.env.update({"OTEL_BSP_SCHEDULE_DELAY": "50",
                         "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
        with proc as r:
            response = requests.post(r.url + "/v1/completions", stream=True, timeout=60,
                                     json={"prompt": "__die__", "stream": True, "max_tokens": 8})
            events = sse_texts(response)
            first = events[0]["backend"]
            victim, other = (x, y) if first == "x" else (y, x)
            wait_until(lambda: not victim.alive(), 30, "the replica to die")
            assert events[-1] == {"done": True}
            # the other went on after the two tokens (the router asked it for 8 - 2 more)
            assert [e["backend"] for e in events[:-1]] == [first] * 2 + [other.name[-1]] * 6
            assert all("token_ids" not in e["choices"][0] for e in events[:-1])
            assert metric(r, "quire_router:migrations_total", reason="connection_lost") == 1
            span = receiver.wait_for(
                lambda s: any(name == "quire.migration" for name, _ in s.events),
                "the router span with the migration")
    ((_, attributes),) = [e for e in span.events if e[0] == "quire.migration"]
    assert (attributes["quire.migration.from"], attributes["quire.migration.to"]) == \
        (victim.url, other.url)
    assert attributes["quire.migration.reason"] == "connection_lost"
    assert span.attributes["quire.request.priority"] == 0
