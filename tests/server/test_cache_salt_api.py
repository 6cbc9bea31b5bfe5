"""cache_salt over HTTP (vLLM's field): requests share prefix-cache blocks only with requests of
the same salt, as usage.prompt_tokens_details.cached_tokens shows; bad salts get 400 naming
cache_salt; the cached figure is in the final usage chunk of a stream, in the Prometheus
histogram and in the request's log line."""

from __future__ import annotations

import json
import random

import pytest
import requests

from server_harness import metric, metrics_of, server

BLOCK = 16  # the server's default block size


@pytest.fixture(scope="module")
def srv():
    return server("smollm")  # prefix caching on


def prompt_ids(seed: int, n: int = 81) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def full_blocks(prompt_tokens: int) -> int:
    """What a complete prefix hit covers: the full blocks before the last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def complete(srv, prompt, salt=None, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 2, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    r = requests.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_same_salt_shares_and_other_salts_or_none_do_not(srv):
    prompt = prompt_ids(3601)

    def cached(salt):
        return complete(srv, prompt, salt)["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    assert cached("alice") == 80          # the same tenant: every full block is a hit
    assert cached("bob") == 0             # another tenant: none
    assert cached(None) == 0              # no salt does not share with a salt
    assert cached(None) == 80             # ... but with no salt
    assert cached("bob") == 80
    assert cached("Alice") == 0           # salts are compared exactly


def test_generate_takes_the_salt_and_the_histogram_counts_cached_tokens(srv):
    prompt = prompt_ids(3602)
    complete(srv, prompt, "carol")
    before = metrics_of(srv)
    r = requests.post(srv.url + "/generate",
                      json={"prompt": prompt, "max_tokens": 2, "cache_salt": "carol"}, timeout=120)
    assert r.status_code == 200, r.text
    r = requests.post(srv.url + "/generate",
                      json={"prompt": prompt, "max_tokens": 2, "cache_salt": "dave"}, timeout=120)
    assert r.status_code == 200, r.text
    after = metrics_of(srv)

    def grew(name):
        return metric(after, name) - metric(before, name)

    assert grew("quire:request_prompt_cached_tokens_count") == 2
    assert grew("quire:request_prompt_cached_tokens_sum") == 80  # carol's hit, dave's none
    assert grew("quire:prompt_tokens_cached_total") == 80
    assert grew("vllm:prompt_tokens_cached_total") == 80  # --metrics-compat vllm


def test_chat_reports_cached_tokens_whole_and_in_the_final_usage_chunk(srv):
    messages = [{"role": "system", "content": "You answer questions about tide tables. " * 6},
                {"role": "user", "content": "When is high tide?"}]
    body = {"messages": messages, "max_tokens": 2, "cache_salt": "erin"}
    first = requests.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = requests.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()
    hit = full_blocks(second["usage"]["prompt_tokens"])
    assert hit >= 3 * BLOCK and second["usage"]["prompt_tokens_details"]["cached_tokens"] == hit

    def streamed_usage(salt):
        r = requests.post(srv.url + "/v1/chat/completions", stream=True, timeout=120, json={
            **body, "cache_salt": salt, "stream": True,
            "stream_options": {"include_usage": True}})
        events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert events[-1]["choices"] == []
        return events[-1]["usage"]

    assert streamed_usage("erin")["prompt_tokens_details"]["cached_tokens"] == hit
    assert streamed_usage("frank")["prompt_tokens_details"]["cached_tokens"] == 0


def test_streamed_completions_report_cached_tokens_over_every_prompt(srv):
    a, b = prompt_ids(3603), prompt_ids(3604, n=40)
    complete(srv, a, "gina")
    r = requests.post(srv.url + "/v1/completions", stream=True, timeout=120, json={
        "prompt": [a, b], "max_tokens": 2, "cache_salt": "gina", "stream": True,
        "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 80}  # a's only


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 1}),
    ("/generate", {"prompt": "hi", "max_tokens": 1}),
])
@pytest.mark.parametrize("salt", ["", "s" * 1025, 7, ["a"]])
def test_a_bad_salt_gets_400_naming_cache_salt(srv, path, body, salt):
    r = requests.post(srv.url + path, json={**body, "cache_salt": salt}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "cache_salt" and "cache_salt" in error["message"]


def test_the_longest_salt_allowed_is_accepted(srv):
    assert complete(srv, "hi", "s" * 1024)["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_finished_request_log_line_has_the_cached_tokens():
    tiny = server("tiny")  # --log-requests (prefix caching off: nothing is cached)
    since = len(tiny.log_lines())
    r = requests.post(tiny.url + "/v1/completions", headers=tiny.headers, timeout=120,
                      json={"prompt": "hello there", "max_tokens": 2, "cache_salt": "h"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    request_id = r.json()["id"]
    lines = [line for line in tiny.log_lines()[since:] if request_id in line]
    assert any("finished: 2 tokens, 0 prompt tokens cached" in line for line in lines), lines
