"""Reasoning output through the HTTP API: `quire serve --reasoning-parser qwen3` on a tiny
Qwen3-style model (reasoning_model.py: `<think>` / `</think>` added tokens, a template that
honours enable_thinking, answers drawn at random from an alphabet holding the tags whole and
in pieces). Every answer is checked against the raw text of the same sampled tokens (the same
prompt ids and seed through /v1/completions): reasoning_content is what comes before the first
`</think>` (less a leading `<think>`), content what follows it, and the streamed pieces
concatenate to exactly those fields. The server's default chat_template_kwargs turn thinking
off; requests turn it back on."""

from __future__ import annotations

import json

import pytest
import requests

from reasoning_model import save_reasoning_model
from server_harness import ServerProcess, tmp_root

ASK = [{"role": "user", "content": "Is 7 prime?"}]
THINK_ON = {"enable_thinking": True}
MAX_TOKENS = 40
SEEDS = (1, 2, 3, 4, 5)


@pytest.fixture(scope="module")
def srv():
    path = save_reasoning_model(f"{tmp_root()}/reasoning-model")
    s = ServerProcess("reasoning", [
        path, "--dtype", "float32", "--kv-cache-memory", "16M", "--num-threads", "1",
        "--max-model-len", "512", "--reasoning-parser", "qwen3",
        "--default-chat-template-kwargs", json.dumps({"enable_thinking": False})])
    s.start()
    try:
        s.wait_ready(300)
        yield s
    finally:
        s.stop()


def _post(srv, path: str, body: dict) -> dict:
    r = requests.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(srv, **body) -> dict:
    return _post(srv, "/v1/chat/completions", {"messages": ASK, "max_tokens": MAX_TOKENS,
                                               "temperature": 1.0, **body})


def _stream(srv, **body) -> dict[int, dict]:
    """Per choice: the concatenated delta.reasoning_content and delta.content, the pieces and
    the finish_reason."""
    r = requests.post(srv.url + "/v1/chat/completions", stream=True, timeout=120,
                      json={"messages": ASK, "max_tokens": MAX_TOKENS, "temperature": 1.0,
                            "stream": True, **body})
    assert r.status_code == 200, r.text
    out: dict[int, dict] = {}
    for line in r.iter_lines():
        if not line:
            continue
        data = line.decode()[len("data: "):]
        if data == "[DONE]":
            break
        for choice in json.loads(data)["choices"]:
            c = out.setdefault(choice["index"], {"reasoning": "", "content": "", "pieces": [],
                                                 "finish_reason": None})
            delta = choice["delta"]
            c["reasoning"] += delta.get("reasoning_content") or ""
            c["content"] += delta.get("content") or ""
            c["pieces"].append(delta)
            c["finish_reason"] = choice["finish_reason"] or c["finish_reason"]
    return out


def _raw_texts(srv, kwargs: dict | None, **body) -> list[str]:
    """The answers' raw text: the chat prompt's ids, sampled the same way on /v1/completions."""
    ids = _post(srv, "/tokenize", {"messages": ASK, "chat_template_kwargs": kwargs})["tokens"]
    r = _post(srv, "/v1/completions", {"prompt": ids, "max_tokens": MAX_TOKENS,
                                       "temperature": 1.0, **body})
    return [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]


def _expected(raw: str) -> tuple[str | None, str | None]:
    """vLLM's Qwen3 reading with thinking on: a leading <think> dropped, reasoning up to the
    first </think>, content after it; no </think>: all reasoning (cut off while thinking)."""
    body = raw
    rest = raw.lstrip()
    if rest.startswith("<think>"):
        body = raw[:len(raw) - len(rest)] + rest[len("<think>"):]
    reasoning, sep, content = body.partition("</think>")
    return (reasoning or None, content or None) if sep else (body or None, None)


def test_thinking_answers_split_exactly_whole_and_streamed(srv):
    both = 0
    for seed in SEEDS:
        raws = _raw_texts(srv, THINK_ON, seed=seed, n=2)
        whole = _chat(srv, seed=seed, n=2, chat_template_kwargs=THINK_ON)
        streamed = _stream(srv, seed=seed, n=2, chat_template_kwargs=THINK_ON)
        for choice in whole["choices"]:
            i, msg = choice["index"], choice["message"]
            assert (msg["reasoning_content"], msg["content"]) == _expected(raws[i]), raws[i]
            assert "</think>" not in (msg["reasoning_content"] or "")
            assert streamed[i]["reasoning"] == (msg["reasoning_content"] or "")
            assert streamed[i]["content"] == (msg["content"] or "")
            assert streamed[i]["finish_reason"] == choice["finish_reason"] == "length"
            assert not msg["tool_calls"]
            both += bool(msg["reasoning_content"] and msg["content"])
    assert both >= 3  # the alphabet makes most answers close their thinking mid-way


def test_enable_thinking_false_renders_the_empty_block_and_all_is_content(srv):
    on = _post(srv, "/tokenize", {"messages": ASK, "chat_template_kwargs": THINK_ON})
    for kwargs in (None, {"enable_thinking": False}):  # the server's default, and explicit
        off = _post(srv, "/tokenize", {"messages": ASK, "chat_template_kwargs": kwargs})
        text = _post(srv, "/detokenize", {"tokens": off["tokens"]})["prompt"]
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert off["tokens"][:on["count"]] == on["tokens"] and off["count"] > on["count"]
        body = {"chat_template_kwargs": kwargs} if kwargs is not None else {}
        for seed in SEEDS[:3]:
            raw = _raw_texts(srv, kwargs, seed=seed)[0]
            msg = _chat(srv, seed=seed, **body)["choices"][0]["message"]
            assert msg["reasoning_content"] is None and msg["content"] == raw
            streamed = _stream(srv, seed=seed, **body)[0]
            assert streamed["content"] == raw and streamed["reasoning"] == ""
    on_text = _post(srv, "/detokenize", {"tokens": on["tokens"]})["prompt"]
    assert on_text.endswith("<|im_start|>assistant\n") and "<think>" not in on_text


def test_a_grammar_constrained_answer_is_content_and_its_tool_call_parses(srv):
    tool = {"type": "function", "function": {
        "name": "is_prime", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
            "required": ["n"], "additionalProperties": False}}}
    r = _chat(srv, seed=3, max_tokens=60, tools=[tool], tool_choice="required",
              parallel_tool_calls=False, chat_template_kwargs=THINK_ON)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["reasoning_content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "is_prime"
    assert set(json.loads(call["function"]["arguments"])) == {"n"}


@pytest.mark.parametrize("kwargs, needle", [
    ("enable_thinking", "chat_template_kwargs"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"tools": []}, "tools"),
])
def test_bad_chat_template_kwargs_get_400_naming_the_field(srv, kwargs, needle):
    for path, body in (("/v1/chat/completions", {"messages": ASK, "max_tokens": 1}),
                       ("/tokenize", {"messages": ASK})):
        r = requests.post(srv.url + path, json={**body, "chat_template_kwargs": kwargs},
                          timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "chat_template_kwargs" and needle in err["message"]


def _sse(srv, path: str, body: dict) -> list[dict]:
    """The data of each server-sent event of a streamed answer."""
    r = requests.post(srv.url + path, json={**body, "stream": True}, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    return [json.loads(line[len("data: "):]) for line in r.iter_lines(decode_unicode=True)
            if line.startswith("data: ")]


def test_responses_and_messages_carry_the_reasoning_as_chat_splits_it(srv):
    """/v1/responses: a reasoning item before the message; /v1/messages: a thinking block
    before the text; whole and streamed, equal to chat's reasoning_content and content."""
    model = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    checked = 0
    for seed in SEEDS:
        msg = _chat(srv, seed=seed, chat_template_kwargs=THINK_ON)["choices"][0]["message"]
        reasoning, content = msg["reasoning_content"] or "", msg["content"] or ""
        common = {"seed": seed, "temperature": 1.0}
        r = _post(srv, "/v1/responses", {"input": ASK[0]["content"], "max_output_tokens":
                                         MAX_TOKENS, "chat_template_kwargs": THINK_ON, **common})
        kinds = [item["type"] for item in r["output"]]
        assert kinds == ["reasoning"] * bool(reasoning) + ["message"]
        if reasoning:
            assert r["output"][0]["content"][0]["text"] == reasoning
            assert r["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
        assert r["output"][-1]["content"][0]["text"] == content
        events = _sse(srv, "/v1/responses", {"input": ASK[0]["content"],
                                             "max_output_tokens": MAX_TOKENS,
                                             "chat_template_kwargs": THINK_ON, **common})
        assert "".join(e["delta"] for e in events
                       if e["type"] == "response.reasoning_text.delta") == reasoning
        assert "".join(e["delta"] for e in events
                       if e["type"] == "response.output_text.delta") == content
        assert [e["item"]["type"] for e in events
                if e["type"] == "response.output_item.done"] == kinds
        m = _post(srv, "/v1/messages", {"model": model, "messages": ASK,
                                        "max_tokens": MAX_TOKENS,
                                        "thinking": {"type": "enabled"}, **common})
        blocks = [(b["type"], b.get("thinking", b.get("text"))) for b in m["content"]]
        assert blocks == [("thinking", reasoning)] * bool(reasoning) + \
            [("text", content)] * bool(content)
        events = _sse(srv, "/v1/messages", {"model": model, "messages": ASK,
                                            "max_tokens": MAX_TOKENS,
                                            "thinking": {"type": "enabled"}, **common})
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert "".join(d.get("thinking", "") for d in deltas) == reasoning
        assert "".join(d.get("text", "") for d in deltas) == content
        checked += bool(reasoning and content)
    assert checked >= 1
