"""A 400's `param` is the field the library's validation error carries, on every endpoint
(as that endpoint's request spells it), with the allowed range in the message; an error that
carries no field answers param null whatever its message says.

The app runs in this process over the tiny model (TestClient), with no server subprocess."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from quire.config import EngineArgs
from quire.engine.async_engine import AsyncLLMEngine
from quire.entrypoints.api_server import build_app
from quire.entrypoints.errors import engine_error, invalid_input
from quire.entrypoints.openai_protocol import SAMPLING_FIELDS
from quire.sampling_params import SamplingParams
from quire.validation import QuireValidationError

from server_harness import tiny_model

C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
MAX_NUM_SEQS = 4
MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
TOO_MANY_TOKENS = "hello " * 1100  # > the tiny model's 1024-token context, few characters

# (path, body, the param the error must name, words of the allowed range in its message)
CASES = [
    # SamplingParams' checks
    (C, {"temperature": -1}, "temperature", ">= 0"),
    (C, {"top_p": 0}, "top_p", "(0, 1]"),
    (C, {"top_p": 1.5}, "top_p", "(0, 1]"),
    (C, {"top_k": -3}, "top_k", "0 or -1"),
    (C, {"min_p": 2}, "min_p", "[0, 1]"),
    (C, {"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    (C, {"presence_penalty": 5}, "presence_penalty", "[-2, 2]"),
    (C, {"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    (C, {"n": 0}, "n", ">= 1"),
    (C, {"n": 100}, "n", f"<= {MAX_NUM_SEQS}"),
    (C, {"seed": -1}, "seed", "[0, "),
    (C, {"logprobs": 50}, "logprobs", "[0, 20]"),
    (C, {"max_tokens": 0}, "max_tokens", "positive integer"),
    (C, {"min_tokens": 30, "max_tokens": 10}, "min_tokens", "<= max_tokens (10)"),
    (C, {"stop": ["ok", ""]}, "stop", "non-empty strings"),
    (C, {"stop_token_ids": [-1]}, "stop_token_ids", "[0, 49152)"),
    # the engine's checks at add_request
    (C, {"max_tokens": 100000}, "max_tokens", "max_tokens must be <="),
    (C, {"prompt": [[1, 2], []]}, "prompt", "non-empty"),
    (C, {"prompt": [10**9]}, "prompt", "[0, "),
    (C, {"prompt": TOO_MANY_TOKENS}, "prompt", "shorter than 1024 tokens"),
    # structured output
    (C, {"response_format": {"type": "xml"}}, "response_format",
     "'text', 'json_object' or 'json_schema'"),
    (C, {"guided_choice": []}, "guided_choice", "non-empty list"),
    (C, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "only one of"),
    (C, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of"),
    # chat: the same checks, under chat's names
    (CHAT, {"temperature": -1}, "temperature", ">= 0"),
    (CHAT, {"top_p": 1.5}, "top_p", "(0, 1]"),
    (CHAT, {"max_tokens": 0}, "max_tokens", "positive integer"),
    (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens", "positive integer"),
    (CHAT, {"max_completion_tokens": 10**6}, "max_completion_tokens", "must be <="),
    (CHAT, {"logprobs": True, "top_logprobs": 99}, "top_logprobs", "[0, 20]"),
    (CHAT, {"stop": ["ok", ""]}, "stop", "non-empty strings"),
    (CHAT, {"messages": [{"role": "user", "content": TOO_MANY_TOKENS}]}, "messages",
     "shorter than 1024 tokens"),
    (CHAT, {"tools": TOOLS, "tool_choice": "always"}, "tool_choice",
     "'none', 'auto', 'required'"),
    (CHAT, {"tools": [{"type": "function", "function": {}}]}, "tools", "non-empty string"),
    (CHAT, {"tool_choice": "required"}, "tool_choice", "requires tools"),
    (CHAT, {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "once"),
    # /generate
    (GEN, {"temperature": -1}, "temperature", ">= 0"),
    (GEN, {"repetition_penalty": -1}, "repetition_penalty", "> 0"),
    (GEN, {"min_tokens": -1}, "min_tokens", ">= 0"),
    (GEN, {"logprobs": 21}, "logprobs", "[0, 20]"),
    (GEN, {"n": 0}, "n", ">= 1"),
    (GEN, {"max_tokens": 0}, "max_tokens", "positive integer"),
    (GEN, {"max_tokens": 100000}, "max_tokens", "max_tokens must be <="),
    (GEN, {"prompt": []}, "prompt", "non-empty"),
    (GEN, {"prompt": [-1]}, "prompt", "[0, "),
]


@pytest.fixture(scope="module")
def client():
    engine = AsyncLLMEngine(EngineArgs(model=tiny_model(), dtype="float32",
                                       kv_cache_memory=16 << 20, num_threads=1,
                                       max_num_seqs=MAX_NUM_SEQS))
    with TestClient(build_app(engine, trim_memory=False)) as c:
        deadline = time.monotonic() + 300
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the tiny model did not load"
            time.sleep(0.1)
        yield c


def _body(path: str, extra: dict) -> dict:
    base = {"messages": MSG} if path == CHAT else {"prompt": "hi"}
    return {**base, "max_tokens": 4, **extra}


@pytest.mark.parametrize("path,extra,param,allowed", CASES,
                         ids=[f"{p.rsplit('/', 1)[1]}-{'-'.join(e)}" for p, e, _, _ in CASES])
def test_bad_input_is_400_naming_the_field_and_the_allowed_range(client, path, extra, param,
                                                                   allowed):
    r = client.post(path, json=_body(path, extra))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert param in err["message"] and allowed in err["message"], err


def test_the_server_still_answers_after_bad_input(client):
    r = client.post(GEN, json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["text"]) == 1


@pytest.mark.parametrize("path", [C, CHAT, GEN])
def test_an_error_without_a_field_names_no_param(client, monkeypatch, path):
    """The engine refuses with a message that starts with a field's name, but carries no
    field: nothing reads the message for one."""
    llm_engine = client.app.state.engine.engine

    def refuse(*args, **kwargs):
        raise ValueError("max_tokens must be <= 3, got 4")

    monkeypatch.setattr(llm_engine, "add_request", refuse)
    r = client.post(path, json=_body(path, {}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is None and err["message"].endswith("max_tokens must be <= 3, got 4")

    def refuse_typed(*args, **kwargs):
        raise QuireValidationError("max_tokens", "max_tokens must be <= 3, got 4", 4)

    monkeypatch.setattr(llm_engine, "add_request", refuse_typed)
    err = client.post(path, json=_body(path, {})).json()["error"]
    assert err["param"] == "max_tokens"  # the same refusal, with its field


def test_sampling_checks_without_a_field_name_no_param(client, monkeypatch):
    import quire.entrypoints.openai_protocol as protocol

    def untyped(**kwargs):
        raise ValueError("temperature must be >= 0, got 5")

    monkeypatch.setattr(protocol, "SamplingParams", untyped)
    r = client.post(C, json=_body(C, {"temperature": 5}))
    assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text


def test_the_mapping_reads_the_field_never_the_message():
    plain = ValueError("prompt is 5000 tokens; prompts must be shorter than 1024 tokens")
    assert engine_error(plain).param is None
    assert engine_error(plain, {"prompt": "messages"}).param is None
    typed = QuireValidationError("prompt", str(plain), 5000)
    assert engine_error(typed).param == "prompt"
    renamed = engine_error(typed, {"prompt": "messages"})
    assert renamed.param == "messages" and renamed.message == f"messages: {plain}"
    # a field that the message does not start with is still the param
    assert invalid_input(QuireValidationError("tools", "a function's schema is bad")).param \
        == "tools"


def test_the_request_models_sampling_fields_are_sampling_params_fields():
    """The fields forwarded to SamplingParams come from the request model: each is one of
    SamplingParams' own, and every SamplingParams field a request can set is either among
    them or set by the endpoint itself."""
    params = set(SamplingParams.__dataclass_fields__)
    assert set(SAMPLING_FIELDS) <= params
    assert params - set(SAMPLING_FIELDS) == {"max_tokens", "logprobs", "output_kind",
                                             "guided_decoding", "prompt_logprobs"}
