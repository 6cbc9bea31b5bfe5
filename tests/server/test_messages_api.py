"""/v1/messages and /v1/messages/count_tokens through the official anthropic client against
`quire serve` on the default model (SmolLM2): plain, streamed (Anthropic's event sequence),
stop_sequences and tools (forced, streamed, and a tool_result round trip), each equal to the
chat completion of the same conversation at temperature 0; token counts equal to the chat
prompt's; every bad field a 400 in Anthropic's error shape naming it, never a 500; the API key
also as x-api-key, and refused in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import pytest
import requests
from smollm_fixtures import client, srv  # noqa: F401 (fixtures)

from server_harness import API_KEY, SMOLLM_NAME, server

SYSTEM = "Answer in one short sentence."
QUESTION = "What is the capital of France?"
MAX = 24
GREEDY = {"temperature": 0}  # the SDK no longer takes sampling fields as arguments
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
TIME_SCHEMA = {"type": "object",
               "properties": {"timezone": {"type": "string", "maxLength": 20}},
               "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": WEATHER_SCHEMA},
         {"name": "get_time", "description": "Current time in a timezone",
          "input_schema": TIME_SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"],
                                                "description": t["description"],
                                                "parameters": t["input_schema"]}}
              for t in TOOLS]
WEATHER_ASK = "What's the weather like in Paris?"
USER = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def aclient(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=300)


def _chat(client, messages, max_tokens=MAX, **kwargs):
    return client.chat.completions.create(model=SMOLLM_NAME, messages=messages,
                                          max_tokens=max_tokens, temperature=0, **kwargs)


def _message(aclient, messages, max_tokens=MAX, **kwargs):
    return aclient.messages.create(model=SMOLLM_NAME, max_tokens=max_tokens,
                                   messages=messages, extra_body=GREEDY, **kwargs)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain_message_equals_the_chat_completion(client, aclient):
    m = _message(aclient, [{"role": "user", "content": QUESTION}], system=SYSTEM)
    c = _chat(client, [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": QUESTION}])
    assert _text(m) and _text(m) == c.choices[0].message.content
    assert m.type == "message" and m.role == "assistant" and m.model == SMOLLM_NAME
    assert m.id.startswith("msg_") and [b.type for b in m.content] == ["text"]
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        c.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert m.usage.output_tokens == c.usage.completion_tokens


def test_text_blocks_and_a_cut_equal_chat(client, aclient):
    m = _message(aclient, [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
                 system=[{"type": "text", "text": SYSTEM}], max_tokens=3)
    c = _chat(client, [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": QUESTION}], max_tokens=3)
    assert _text(m) == c.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stop_sequences_stop_and_are_reported(client, aclient):
    full = _chat(client, [{"role": "user", "content": QUESTION}]).choices[0].message.content
    word = full.split()[2]  # a word the greedy answer reaches
    m = _message(aclient, [{"role": "user", "content": QUESTION}], stop_sequences=[word])
    c = _chat(client, [{"role": "user", "content": QUESTION}], stop=[word])
    assert _text(m) == c.choices[0].message.content and word not in _text(m)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word


def test_streamed_message_is_anthropics_event_sequence(srv, client, aclient):
    events = list(aclient.messages.create(
        model=SMOLLM_NAME, max_tokens=MAX, messages=[{"role": "user", "content": QUESTION}],
        stream=True, extra_body=GREEDY))
    c = _chat(client, [{"role": "user", "content": QUESTION}])
    types = [e.type for e in events]  # (the SDK drops the ping)
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    assert events[1].content_block.type == "text" and events[1].index == 0
    raw = requests.post(srv.url + "/v1/messages", stream=True, timeout=120, json={
        "model": SMOLLM_NAME, "max_tokens": MAX, "messages": USER, "stream": True, **GREEDY})
    names = [line[len("event: "):] for line in raw.iter_lines(decode_unicode=True)
             if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[3:] == types[2:]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == c.choices[0].message.content
    delta = events[-2]
    assert delta.delta.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        c.choices[0].finish_reason]
    assert delta.usage.output_tokens == c.usage.completion_tokens
    assert events[0].message.usage.input_tokens == c.usage.prompt_tokens
    with aclient.messages.stream(model=SMOLLM_NAME, max_tokens=MAX, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": QUESTION}]) as s:
        final = s.get_final_message()
    assert _text(final) == text and final.stop_reason == delta.delta.stop_reason


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_time"}])
def test_tool_use_equals_the_chat_completion(client, aclient, choice):
    chat_choice = "required" if choice["type"] == "any" else {
        "type": "function", "function": {"name": choice["name"]}}
    c = _chat(client, [{"role": "user", "content": WEATHER_ASK}], max_tokens=80,
              tools=CHAT_TOOLS, tool_choice=chat_choice, parallel_tool_calls=False)
    calls = [(t.function.name, json.loads(t.function.arguments))
             for t in c.choices[0].message.tool_calls]
    m = _message(aclient, [{"role": "user", "content": WEATHER_ASK}], max_tokens=80,
                 tools=TOOLS, tool_choice=choice)
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == calls
    assert m.stop_reason == "tool_use" and all(b.id.startswith("toolu_") for b in m.content)
    if choice["type"] == "tool":
        assert calls[0][0] == "get_time"
    events = list(aclient.messages.create(
        model=SMOLLM_NAME, max_tokens=80, messages=[{"role": "user", "content": WEATHER_ASK}],
        tools=TOOLS, tool_choice=choice, stream=True, extra_body=GREEDY))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    assert starts[0].content_block.name == calls[0][0] and starts[0].content_block.input == {}
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert partial == c.choices[0].message.tool_calls[0].function.arguments
    assert [e for e in events if e.type == "message_delta"][0].delta.stop_reason == "tool_use"


def test_a_tool_result_round_trip_equals_chat(client, aclient):
    call_input = {"city": "Paris"}
    m = _message(aclient, [
        {"role": "user", "content": WEATHER_ASK},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": call_input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
            {"type": "text", "text": "Summarise it."}]}], tools=TOOLS, system=SYSTEM)
    c = _chat(client, [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": WEATHER_ASK},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call_input)}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "Summarise it."}], tools=CHAT_TOOLS)
    assert _text(m) == (c.choices[0].message.content or "")
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == [
        (t.function.name, json.loads(t.function.arguments))
        for t in c.choices[0].message.tool_calls or []]


def test_count_tokens_is_the_prompt_the_message_would_send(client, aclient):
    messages = [{"role": "user", "content": WEATHER_ASK}]
    counted = aclient.messages.count_tokens(model=SMOLLM_NAME, messages=messages,
                                            system=SYSTEM, tools=TOOLS)
    c = _chat(client, [{"role": "system", "content": SYSTEM}, *messages], max_tokens=1,
              tools=CHAT_TOOLS)
    assert counted.input_tokens == c.usage.prompt_tokens
    plain = aclient.messages.count_tokens(model=SMOLLM_NAME, messages=messages)
    assert plain.input_tokens < counted.input_tokens


BAD_FIELDS = [
    ({"model": None}, "model"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * (16 * 2048 + 1)}]}, "messages"),
    ({"system": 5}, "system"),
    ({"stop_sequences": "Paris"}, "stop_sequences"),
    ({"stop_sequences": ["x"] * 100}, "stop_sequences"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": "x"}, "top_k"),
    ({"stream": "yes"}, "stream"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tools": [{"name": "f"}]}, "tools"),
    ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "maybe"}}, "thinking"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     "output_config"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"metadata": 5}, "metadata"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS,
                         ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_FIELDS)])
def test_bad_fields_get_400_in_anthropics_shape_naming_them(srv, fields, param):
    body = {"model": SMOLLM_NAME, "max_tokens": 4, "messages": USER, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = requests.post(srv.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    payload = r.json()
    assert payload["type"] == "error" and set(payload) == {"type", "error"}
    assert payload["error"]["type"] == "invalid_request_error"
    assert param in payload["error"]["message"], payload


def test_sdk_errors_are_anthropics(aclient):
    with pytest.raises(anthropic.NotFoundError) as e:
        aclient.messages.create(model="nope", max_tokens=4, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        aclient.messages.count_tokens(model=SMOLLM_NAME, messages=[])
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": e.value.body["error"]["message"]}}
    assert "messages" in e.value.body["error"]["message"]


def test_the_api_key_is_also_taken_as_x_api_key():
    tiny = server("tiny")
    model = requests.get(tiny.url + "/v1/models", headers=tiny.headers,
                         timeout=30).json()["data"][0]["id"]
    good = anthropic.Anthropic(base_url=tiny.url, api_key=API_KEY, max_retries=0, timeout=300)
    m = good.messages.create(model=model, max_tokens=2, messages=USER)
    assert m.usage.output_tokens <= 2
    bad = anthropic.Anthropic(base_url=tiny.url, api_key="wrong", max_retries=0, timeout=300)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=model, max_tokens=2, messages=USER)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    # the OpenAI endpoints keep OpenAI's shape
    r = requests.post(tiny.url + "/v1/responses", json={"input": "hi"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_cache_salt_keeps_prefix_cache_hits_apart(aclient):
    ask = {"messages": USER, "system": SYSTEM * 4, "max_tokens": 2}
    aclient.messages.create(model=SMOLLM_NAME, **ask)
    hit = aclient.messages.create(model=SMOLLM_NAME, **ask)
    assert hit.usage.cache_read_input_tokens >= 16
    salted = aclient.messages.create(model=SMOLLM_NAME, **ask,
                                     extra_body={"cache_salt": "tenant-9c1"})
    assert salted.usage.cache_read_input_tokens == 0
    total = salted.usage.input_tokens
    again = aclient.messages.create(model=SMOLLM_NAME, **ask,
                                    extra_body={"cache_salt": "tenant-9c1"})
    assert again.usage.cache_read_input_tokens >= 16
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
