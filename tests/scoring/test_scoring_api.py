"""Scoring over HTTP, as eval harnesses ask for it: /v1/completions' echo with logprobs
(token-id and text prompts, max_tokens 0 and 1, streamed), vLLM's prompt_logprobs on
completions and chat, all within 1e-4 of transformers float32 on a server that prefills in
16-token chunks and keeps a prefix cache; and the 400s for bad input."""

from __future__ import annotations

import json

import pytest
import requests

from quire.models.loader import load_tokenizer, materialize, resolve_model

from runtime_helpers import random_prompts
from scoring_server import hf_logprobs, running_server, scoring_server_args
from server_harness import tiny_model

TOL = 1e-4


@pytest.fixture(scope="module")
def srv():
    with running_server("scoring", scoring_server_args()) as s:
        yield s


@pytest.fixture(scope="module")
def reference():
    return hf_logprobs(tiny_model())


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(materialize(resolve_model(tiny_model())), None)


def _post(srv, path: str, body: dict) -> requests.Response:
    return requests.post(srv.url + path, json=body, timeout=120)


def _assert_echo_matches(choice: dict, prompt: list[int], ref, k: int) -> None:
    lps = choice["logprobs"]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for pos in range(1, len(prompt)):
        assert abs(lps["token_logprobs"][pos] - ref[pos - 1, prompt[pos]].item()) < TOL, pos
        top = lps["top_logprobs"][pos]
        assert k <= len(top) <= k + 1
        assert abs(max(top.values()) - ref[pos - 1].max().item()) < TOL


def test_echo_logprobs_with_max_tokens_0_score_the_prompt(srv, reference, tokenizer):
    """What lm-eval sends for loglikelihood, with max_tokens 0: the prompt's tokens and their
    logprobs, nothing generated."""
    prompts = random_prompts(lengths=[5, 40], seed=11)
    r = _post(srv, "/v1/completions", {"prompt": prompts, "max_tokens": 0, "echo": True,
                                       "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 0
    for prompt, choice in zip(prompts, sorted(body["choices"], key=lambda c: c["index"])):
        assert len(choice["logprobs"]["tokens"]) == len(prompt)
        assert choice["text"] == tokenizer.decode(prompt)
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
        _assert_echo_matches(choice, prompt, reference(prompt), 1)


def test_echo_logprobs_with_a_generated_token_and_a_prefix_cache_hit(srv, reference):
    """lm-eval's own request (max_tokens 1): the prompt's logprobs, then the token's. The
    prompt was served before, so its prefix is in the cache: the scores are all there."""
    prompt = random_prompts(lengths=[70], seed=12)[0]
    warm = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                          "temperature": 0})
    assert warm.status_code == 200
    again = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                           "temperature": 0})
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    r = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "echo": True,
                                       "logprobs": 2, "temperature": 0, "seed": 1234})
    choice = r.json()["choices"][0]
    ref = reference(prompt)
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
    _assert_echo_matches(choice, prompt, ref, 2)
    # the generated token is the greedy one, with its own logprob last
    assert abs(choice["logprobs"]["token_logprobs"][-1] - ref[-1].max().item()) < TOL


def test_prompt_logprobs_on_completions_in_vllms_shape(srv, reference, tokenizer):
    text = "The quick brown fox jumps over the lazy dog, " * 4
    prompt = tokenizer(text).input_ids
    r = _post(srv, "/v1/completions", {"prompt": text, "max_tokens": 2, "temperature": 0,
                                       "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["prompt_logprobs"]
    ref = reference(prompt)
    assert len(lps) == len(prompt) and lps[0] is None
    for pos in range(1, len(prompt)):
        entry = lps[pos]
        assert 3 <= len(entry) <= 4
        mine = entry[str(prompt[pos])]
        assert abs(mine["logprob"] - ref[pos - 1, prompt[pos]].item()) < TOL
        assert mine["decoded_token"] == tokenizer.decode([prompt[pos]])
        assert mine["rank"] >= 1
        best = min(entry.values(), key=lambda e: e["rank"])
        assert best["rank"] == 1 and abs(best["logprob"] - ref[pos - 1].max().item()) < TOL


def test_prompt_logprobs_on_chat(srv, reference, tokenizer):
    messages = [{"role": "user", "content": "Score every token of this conversation."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    r = _post(srv, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                            "temperature": 0, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    lps = r.json()["prompt_logprobs"]
    ref = reference(list(prompt))
    assert len(lps) == len(prompt) and lps[0] is None
    for pos in range(1, len(prompt)):
        mine = lps[pos][str(prompt[pos])]
        assert abs(mine["logprob"] - ref[pos - 1, prompt[pos]].item()) < TOL


def test_streamed_echo_carries_the_prompt_logprobs_first(srv, reference):
    prompt = random_prompts(lengths=[30], seed=13)[0]
    with requests.post(srv.url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "stream": True,
            "temperature": 0}, stream=True, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    _assert_echo_matches(first, prompt, reference(prompt), 1)
    tokens = sum((c["choices"][0]["logprobs"]["tokens"] for c in chunks
                  if c["choices"] and c["choices"][0]["logprobs"]), [])
    assert len(tokens) == len(prompt) + 3


def test_streamed_echo_with_max_tokens_0_counts_and_shows_no_generated_token(srv, reference):
    """The engine samples one token to score the prompt; the client never sees it, so a
    stream's usage and token ids leave it out, as the whole response's usage does."""
    prompt = random_prompts(lengths=[12], seed=14)[0]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    with requests.post(srv.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 0
    assert usage["total_tokens"] == usage["prompt_tokens"] == len(prompt)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert sum((c["token_ids"] for c in choices), []) == []
    assert choices[0]["prompt_token_ids"] == prompt
    tokens = sum((c["logprobs"]["tokens"] for c in choices if c["logprobs"]), [])
    assert len(tokens) == len(prompt)
    _assert_echo_matches(choices[0], prompt, reference(prompt), 1)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -2}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "3"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "prompt_logprobs": 99}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_scoring_input_is_a_400_naming_the_field(srv, path, body, param):
    r = _post(srv, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
