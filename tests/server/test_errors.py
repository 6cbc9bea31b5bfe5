"""Bad input gets a 4xx in OpenAI's error shape naming the parameter, never a 500, and the
server goes on serving; the API key guards the API but not the probes."""

from __future__ import annotations

import pytest
import requests

from server_harness import API_KEY, SMOLLM_NAME, server

LONG_PROMPT = "hello " * 3000  # > --max-model-len 2048
C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
MSG = [{"role": "user", "content": "hi"}]

# (path, JSON body or raw bytes, status, the parameter the error must name)
CASES = [
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hi", "top_k": -3}, 400, "top_k"),
    (C, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    (C, {"prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "n": 1000}, 400, "n"),
    (C, {"prompt": "hi", "n": True}, 400, "n"),
    (C, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (C, {"prompt": "hi", "seed": -1}, 400, "seed"),
    (C, {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    (C, {"prompt": "hi", "stop": ["ok", 1]}, 400, "stop"),
    (C, {"prompt": "hi", "stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    (C, {"prompt": "hi", "min_tokens": 30, "max_tokens": 10}, 400, "min_tokens"),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True,
         "prompt_logprobs": 1}, 400, "prompt_logprobs"),  # echo scores now; not when streamed
    (C, {"prompt": "hi", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [10**9]}, 400, "prompt"),
    (C, {"prompt": [[1, 2], []]}, 400, "prompt"),
    (C, {"prompt": LONG_PROMPT}, 400, "prompt"),
    (C, {}, 400, "prompt"),
    (C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (C, b"{not json", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b"", 400, None),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "model"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    (GEN, {"prompt": "hi", "tempreature": 0.5}, 400, "tempreature"),
    (GEN, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (GEN, {"temperature": 0}, 400, "prompt"),
    (GEN, {"prompt": [-1]}, 400, "prompt"),
    (GEN, b"prompt=hi", 400, None),
    # bounds on every field (limits.py), and no non-finite numbers
    (C, b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    (C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    (C, b'{"prompt": "hi", "top_p": 1e400}', 400, "top_p"),
    (C, b'{"prompt": "hi", "presence_penalty": -Infinity}', 400, "presence_penalty"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": NaN}', 400,
     "frequency_penalty"),
    (C, {"prompt": "hi", "stop": [f"s{i}" for i in range(1000)]}, 400, "stop"),
    (C, {"prompt": "hi", "stop": "x" * 1000}, 400, "stop"),
    (C, {"prompt": "hi", "stop_token_ids": list(range(1000))}, 400, "stop_token_ids"),
    (C, {"prompt": ["hi"] * 100}, 400, "prompt"),
    (C, {"prompt": "x" * 40000}, 400, "prompt"),  # > 16 chars per token of 2048: not tokenized
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": MSG * 1000}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 40000}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "stop": ["a"] * 17}, 400, "stop"),
    (CHAT, {"messages": MSG, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    (GEN, {"prompt": "hi", "stop": ["a"] * 17}, 400, "stop"),
    ("/tokenize", {"prompt": "x" * 40000}, 400, "prompt"),
    ("/detokenize", {"tokens": [1] * 40000}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


@pytest.fixture(scope="module")
def srv():
    return server("smollm")


def _post(url: str, body) -> requests.Response:
    if isinstance(body, bytes):
        return requests.post(url, data=body, headers={"Content-Type": "application/json"},
                             timeout=60)
    return requests.post(url, json=body, timeout=60)


def test_bad_inputs_get_4xx_naming_the_parameter(srv):
    failures = []
    for path, body, status, param in CASES:
        r = _post(srv.url + path, body)
        try:
            err = r.json()["error"]
            ok = (r.status_code == status and err["param"] == param
                  and set(err) == {"message", "type", "param", "code"}
                  and (param is None or param in err["message"]))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            failures.append(f"{path} {str(body)[:80]}: want {status} naming {param}, got "
                            f"{r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    # ... and nothing else was lost: the server still answers correctly
    r = requests.post(srv.url + C, json={"prompt": "hi", "max_tokens": 3, "model": SMOLLM_NAME})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert requests.get(srv.url + "/health").status_code == 200


def test_unknown_route_and_method(srv):
    r = requests.get(srv.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = requests.get(srv.url + C)
    assert r.status_code == 405 and "error" in r.json()


def test_api_key_guards_the_api_not_the_probes():
    srv = server("tiny")  # QUIRE_API_KEY is set in its environment
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for path in (C, GEN, "/tokenize", "/detokenize", "/v1/models"):
            method = requests.get if path == "/v1/models" else requests.post
            r = method(srv.url + path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    good = {"Authorization": f"Bearer {API_KEY}"}
    assert requests.post(srv.url + C, json=body, headers=good).status_code == 200
    assert requests.get(srv.url + "/v1/models", headers=good).status_code == 200
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert requests.get(srv.url + path).status_code == 200, path
