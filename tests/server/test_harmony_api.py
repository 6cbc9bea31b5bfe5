"""gpt-oss's harmony format through the HTTP API: `quire serve --reasoning-parser
openai_gptoss` on a tiny gpt-oss (harmony_model.py: harmony's special tokens, a harmony
template), its answers made harmony by a grammar. The analysis channel lands in
reasoning_content, final in content, a commentary call to a function in tool_calls (picked by
`--tool-call-parser auto` as `openai`), whole and streamed alike; the history of a call and
its result renders through the template."""

from __future__ import annotations

import json

import pytest
import requests
from harmony_model import harmony_grammar, save_harmony_model

from server_harness import ServerProcess, runtime_helpers, tmp_root

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ARGS = '{"city": "Paris"}'
THINK = ("analysis", "The user wants the weather; I should look it up.")
CALL = ("commentary to=functions.get_weather <|constrain|>json", ARGS)
FINAL = ("final", "It is sunny in Paris, 24 °C.")


@pytest.fixture(scope="module")
def srv():
    path = save_harmony_model(f"{tmp_root()}/harmony-model",
                              runtime_helpers().smollm2_tokenizer())
    s = ServerProcess("harmony", [
        path, "--dtype", "float32", "--kv-cache-memory", "16M", "--num-threads", "1",
        "--max-model-len", "1024", "--reasoning-parser", "openai_gptoss"])
    s.start()
    try:
        s.wait_ready(300)
        yield s
    finally:
        s.stop()


def _body(answer, **extra):
    """A chat request whose answer the grammar makes `answer`: harmony messages."""
    return {"messages": ASK, "max_tokens": 80, "temperature": 0,
            "guided_grammar": harmony_grammar(*answer), **extra}


def _chat(srv, answer, **extra) -> dict:
    r = requests.post(srv.url + "/v1/chat/completions", json=_body(answer, **extra),
                      timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _stream(srv, answer, **extra) -> dict:
    r = requests.post(srv.url + "/v1/chat/completions", stream=True, timeout=120,
                      json=_body(answer, stream=True, **extra))
    assert r.status_code == 200, r.text
    out = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None}
    for line in r.iter_lines():
        data = line.decode()[len("data: "):] if line else ""
        if not data or data == "[DONE]":
            continue
        for choice in json.loads(data)["choices"]:
            delta = choice["delta"]
            out["reasoning"] += delta.get("reasoning_content") or ""
            out["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                c = out["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                c["name"] += (call.get("function") or {}).get("name") or ""
                c["arguments"] += (call.get("function") or {}).get("arguments") or ""
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def test_analysis_is_reasoning_and_final_is_content(srv):
    whole = _chat(srv, [THINK, FINAL])
    msg = whole["message"]
    assert msg["reasoning_content"] == THINK[1]
    assert msg["content"] == FINAL[1]
    assert not msg["tool_calls"] and whole["finish_reason"] == "stop"
    streamed = _stream(srv, [THINK, FINAL])
    assert (streamed["reasoning"], streamed["content"]) == (THINK[1], FINAL[1])
    assert streamed["finish_reason"] == "stop" and not streamed["calls"]


def test_commentary_call_is_a_tool_call(srv):
    whole = _chat(srv, [THINK, CALL], tools=TOOLS)
    msg = whole["message"]
    assert msg["reasoning_content"] == THINK[1]
    assert msg["content"] is None
    [call] = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    assert whole["finish_reason"] == "tool_calls"
    streamed = _stream(srv, [THINK, CALL], tools=TOOLS)
    assert streamed["reasoning"] == THINK[1] and streamed["content"] == ""
    assert streamed["calls"] == {0: {"name": "get_weather", "arguments": ARGS}}
    assert streamed["finish_reason"] == "tool_calls"


def test_a_calls_result_renders_and_the_answer_is_final(srv):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
         "content": '{"sky": "sunny", "celsius": 24}'}]
    r = requests.post(srv.url + "/tokenize", json={"messages": history, "tools": TOOLS},
                      timeout=60)
    assert r.status_code == 200, r.text
    text = requests.post(srv.url + "/detokenize", json={"tokens": r.json()["tokens"]},
                         timeout=60).json()["prompt"]
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>"
            f"json<|message|>{ARGS}<|call|>") in text
    assert text.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary'
                         '<|message|>{"sky": "sunny", "celsius": 24}<|end|><|start|>assistant')
    whole = _chat(srv, [FINAL], messages=history, tools=TOOLS)
    assert whole["message"]["content"] == FINAL[1] and not whole["message"]["tool_calls"]
