"""Tool calling through the HTTP API, with the official openai client against `quire serve` on
the default model (SmolLM2: its template knows no tools, so they are rendered Hermes-style):
tool_choice required / named enforced by the grammar, streamed calls equal to whole ones, tool
results round-tripped through the template, tool_choice none, and 400s naming the field.
`auto` parsing is checked on text, without the model (a 135M model rarely calls on its own)."""

from __future__ import annotations

import json

import pytest
import requests
from smollm_fixtures import client, srv  # noqa: F401 (fixtures)

from quire.entrypoints.chat_tools import ToolCallDeltas, ToolUse, message_parts
from quire.entrypoints.tool_calls import get_tool_parser

from server_harness import SMOLLM_NAME, server


def _tool(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(properties), "additionalProperties": False}}}


WEATHER = _tool("get_weather", "Current weather in a city",
                {"city": {"type": "string", "maxLength": 20},
                 "unit": {"enum": ["celsius", "fahrenheit"]}})
TIME = _tool("get_time", "Current time in a timezone", {"timezone": {"type": "string",
                                                                      "maxLength": 20}})
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What's the weather like in Paris?"}]


def _required(client, **kwargs):
    return client.chat.completions.create(
        model=SMOLLM_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0.8, seed=11, max_tokens=80, **kwargs)


def test_required_tool_call_parses_and_streams_the_same(client):
    r = _required(client)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name in ("get_weather",
                                                                          "get_time")
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict) and args

    chunks = list(_required(client, stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    pieces = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    first = pieces[0]  # the name (with the id and type) before any argument
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function.name == call.function.name and not first.function.arguments
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    streamed = "".join(p.function.arguments or "" for p in pieces)
    assert len(pieces) > 2  # the arguments came in several pieces
    assert json.loads(streamed) == args and streamed == call.function.arguments
    assert deltas[-1].finish_reason == "tool_calls"
    assert not any(d.finish_reason for d in deltas[:-1])
    assert not any(d.delta.content for d in deltas)


def test_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(
        model=SMOLLM_NAME, messages=ASK, tools=TOOLS, temperature=0.8, seed=4, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in calls] == ["get_time"]
    assert set(json.loads(calls[0].function.arguments)) == {"timezone"}


def test_tool_result_round_trips_through_the_template(client):
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather",
                                 "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1",
                 "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=SMOLLM_NAME, messages=messages, tools=TOOLS,
                                       temperature=0, max_tokens=24)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    # the call and its result were in the prompt: it is longer than the question alone
    alone = client.chat.completions.create(model=SMOLLM_NAME, messages=ASK, tools=TOOLS,
                                           temperature=0, max_tokens=1)
    assert r.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_tool_choice_none_answers_in_words(client):
    r = client.chat.completions.create(model=SMOLLM_NAME, messages=ASK, tools=TOOLS,
                                       tool_choice="none", temperature=0, max_tokens=16)
    plain = client.chat.completions.create(model=SMOLLM_NAME, messages=ASK, temperature=0,
                                           max_tokens=16)
    assert not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content == plain.choices[0].message.content


ERRORS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "requires tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "always"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
    ({"tools": [WEATHER] * 129}, "tools", "max-tools"),
    ({"tools": [_tool("f", "", {"x": {"type": "string", "format": "no-such-format"}})],
      "tool_choice": "required"}, "tools", "no-such-format"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format"),
    ({"messages": [{"role": "tool", "content": "21C"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", "arguments"),
]


@pytest.mark.parametrize("extra,param,word", ERRORS, ids=[w for _, _, w in ERRORS])
def test_bad_tool_requests_are_400_naming_the_field(srv, extra, param, word):
    r = requests.post(srv.url + "/v1/chat/completions",
                      json={"messages": ASK, "max_tokens": 5, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err


# --- tool_choice auto: the family's parser reads calls out of free text -------------------
AUTO_TEXT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')


def test_auto_reads_calls_out_of_the_text():
    use = ToolUse(TOOLS, get_tool_parser("hermes"))
    content, calls, finish = message_parts(use, AUTO_TEXT, "stop")
    assert finish == "tool_calls" and content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert message_parts(use, "Just words.", "stop") == ("Just words.", [], "stop")

    deltas = ToolCallDeltas(use.parser)
    pieces = [deltas.feed(0, AUTO_TEXT[i:i + 3], None) for i in range(0, len(AUTO_TEXT), 3)]
    pieces.append(deltas.feed(0, "", "stop"))
    assert "".join(c or "" for c, _, _ in pieces) == "Let me check."
    streamed = [tc for _, tcs, _ in pieces for tc in tcs or []]
    assert streamed[0].function.name == "get_weather"
    assert "".join(tc.function.arguments or "" for tc in streamed) == \
        calls[0].function.arguments
    assert pieces[-1][2] == "tool_calls"


def test_serve_flag_lists_every_parser():
    from quire.entrypoints.serve import TOOL_PARSER_NAMES
    from quire.entrypoints.tool_calls import TOOL_PARSERS
    assert set(TOOL_PARSER_NAMES) == set(TOOL_PARSERS)


# A request's own template in the Llama 3.1 style: `auto` detects the llama3_json family, so the
# grammar asks for {"name", "parameters"} and that parser reads it back. On the tiny random
# model the grammar decides every token.
LLAMA3_TEMPLATE = (
    "{% if tools %}Environment: ipython\n{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_auto_parser_follows_a_llama3_template_on_the_tiny_model():
    tiny = server("tiny")
    r = requests.post(tiny.url + "/v1/chat/completions", headers=tiny.headers, timeout=120,
                      json={"messages": ASK, "tools": TOOLS, "chat_template": LLAMA3_TEMPLATE,
                            "tool_choice": {"type": "function",
                                            "function": {"name": "get_weather"}},
                            "max_tokens": 120, "temperature": 1.0, "seed": 7})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call, = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}


# --- an answer max_tokens cuts: the same calls and finish_reason streamed or not ----------
CUT_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"ci')


def _joined(deltas: list) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of streamed chat deltas, joined."""
    calls: dict[int, list] = {}
    for d in deltas:
        for tc in d.delta.tool_calls or []:
            call = calls.setdefault(tc.index, [None, ""])
            if tc.function.name:
                call[0] = tc.function.name
            call[1] += tc.function.arguments or ""
    content = "".join(d.delta.content or "" for d in deltas)
    return content, [tuple(c) for _, c in sorted(calls.items())], deltas[-1].finish_reason


def test_a_cut_answer_reads_the_same_whole_and_streamed_on_text():
    use = ToolUse(TOOLS, get_tool_parser("hermes"))
    content, calls, finish = message_parts(use, CUT_TEXT, "length")
    assert finish == "length" and content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"ci')]
    deltas = ToolCallDeltas(use.parser)
    pieces = [deltas.feed(0, CUT_TEXT[i:i + 4], None) for i in range(0, len(CUT_TEXT), 4)]
    pieces.append(deltas.feed(0, "", "length"))
    streamed = [tc for _, tcs, _ in pieces for tc in tcs or []]
    assert pieces[-1][2] == "length"
    for i, call in enumerate(calls):
        assert "".join(tc.function.arguments or "" for tc in streamed if tc.index == i) == \
            call.function.arguments


@pytest.mark.parametrize("max_tokens", [30, 45])
def test_max_tokens_cutting_a_call_gives_the_same_answer_streamed_or_not(client, max_tokens):
    """The issue's request: required, greedy, one tool, max_tokens cutting a second call."""
    kwargs = dict(model=SMOLLM_NAME, messages=ASK, tools=[WEATHER], tool_choice="required",
                  temperature=0, max_tokens=max_tokens)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length"
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert calls, whole.message
    for _, arguments in calls[:-1]:  # every call before the cut one is complete
        assert isinstance(json.loads(arguments), dict)
    deltas = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True)
              if c.choices]
    content, streamed_calls, finish = _joined(deltas)
    assert finish == "length" and streamed_calls == calls
    assert (content.strip() or None) == whole.message.content
