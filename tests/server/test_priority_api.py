"""Priorities and token ids over HTTP (issue 50): `priority` on completions, chat and /generate
(a 400 naming it when it is not an integer in range), served lower first under
`--scheduling-policy priority`, queue metrics per priority band; `return_token_ids` streams
the ids of each chunk's tokens, and `continue_token_ids` continues an answer exactly where
they stop (what the router's migration sends). Its own tiny float32 server."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from server_harness import ServerProcess, metric, metrics_of, tiny_model

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def srv():
    s = ServerProcess("priority", [tiny_model(), "--dtype", "float32", "--kv-cache-memory", "16M",
                                   "--num-threads", "1", "--max-num-seqs", "1",
                                   "--scheduling-policy", "priority"])
    s.start()
    try:
        s.wait_ready(300)
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/generate", {"prompt": "hi"}),
])
def test_a_bad_priority_is_a_400_naming_it(srv, path, body):
    for bad in ("high", 1.5, 2 ** 31, -(2 ** 31) - 1, None, True):
        r = requests.post(srv.url + path, json={**body, "priority": bad, "max_tokens": 2},
                          timeout=60)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "priority"
    ok = requests.post(srv.url + path, json={**body, "priority": -7, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def stream_ids(srv, body: dict) -> tuple[list[dict], list[int], str]:
    r = requests.post(srv.url + "/v1/completions", stream=True, timeout=120, json={
        **body, "stream": True, "return_token_ids": True, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.iter_lines()
              if line.startswith(b"data: {")]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    return chunks, ids, "".join(c["choices"][0]["text"] for c in chunks)


def test_token_ids_stream_and_a_continuation_joins_up_exactly(srv):
    prompt = [101, 2045, 3100, 42, 7777, 15000, 9, 808]
    chunks, ids, text = stream_ids(srv, {"prompt": prompt, "max_tokens": MAX_TOKENS})
    assert len(ids) == MAX_TOKENS
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    # Continue after 9 tokens: the rest is the same tokens and the same text.
    first = next(i for i in range(len(chunks))
                 if sum(len(c["choices"][0]["token_ids"]) for c in chunks[:i + 1]) >= 9)
    head_ids = [t for c in chunks[:first + 1] for t in c["choices"][0]["token_ids"]]
    head_text = "".join(c["choices"][0]["text"] for c in chunks[:first + 1])
    _, rest_ids, rest_text = stream_ids(srv, {"prompt": prompt, "continue_token_ids": head_ids,
                                              "max_tokens": MAX_TOKENS - len(head_ids)})
    assert head_ids + rest_ids == ids
    assert head_text + rest_text == text
    # Whole answers are not affected; several prompts can't be continued.
    r = requests.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": [prompt, prompt], "continue_token_ids": [5], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_token_ids"


def test_the_urgent_request_runs_before_queued_batch_work(srv):
    """One running slot: a long request runs, two batch requests (priority 5) queue, then an
    urgent one (priority -1): it finishes before both, and the queue metric shows the bands."""
    done: list[str] = []

    def send(name: str, priority: int, max_tokens: int) -> None:
        r = requests.post(srv.url + "/v1/completions", timeout=300, json={
            "prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "priority": priority})
        assert r.status_code == 200
        done.append(name)

    long = threading.Thread(target=send, args=("running", 0, 400))
    long.start()
    batch = [threading.Thread(target=send, args=(f"batch{i}", 5, 8)) for i in range(2)]
    for t in batch:
        t.start()

    def waiting(band: str) -> float:
        try:
            return metric(metrics_of(srv), "quire:num_requests_waiting_by_priority",
                          priority=band)
        except KeyError:  # no sequence in that band yet: no sample
            return 0.0

    deadline = time.monotonic() + 120
    while waiting("5") < 2:
        assert time.monotonic() < deadline, "the batch requests never queued"
        time.sleep(0.05)
    urgent = threading.Thread(target=send, args=("urgent", -1, 8))
    urgent.start()
    for t in (long, urgent, *batch):
        t.join(300)
    assert done.index("urgent") < done.index("batch0") and done.index("urgent") < done.index("batch1")
