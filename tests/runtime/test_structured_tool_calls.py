"""Tool calling without HTTP: family parsers (whole and streamed: the argument deltas
concatenate to the whole parse), parser detection, tool_choice grammars that a tiny random
model must obey, and chat prompts with tools and tool results."""

from __future__ import annotations

import json
import random

import pytest

from quire import LLM, SamplingParams
from quire.entrypoints.tool_calls import (
    detect_tool_parser,
    get_tool_parser,
    render_chat_prompt,
    tool_choice_guided_decoding,
)

from runtime_helpers import save_tiny_model, tiny_config

HERMES_TEXTS = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
     '</tool_call>', None, [("get_weather", '{"city": "Paris", "days": [1, 2]}')]),
    ('Let me check.<tool_call>\n{"name": "a", "arguments": {"s": "} </tool_call> {"}}\n'
     '</tool_call>\n<tool_call>\n{"arguments": {"x": -1.5e3}, "name": "b"}\n</tool_call>',
     "Let me check.", [("a", '{"s": "} </tool_call> {"}'), ("b", '{"x": -1.5e3}')]),
    ('{"name": "b", "arguments": {}}', None, [("b", "{}")]),  # no tags: wrapped below
]
LLAMA_TEXTS = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    ('<|python_tag|>{"name": "f", "arguments": {"q": "a;b"}}; {"name": "g", "parameters": '
     '{"n": [1, {"m": null}]}}', None, [("f", '{"q": "a;b"}'), ("g", '{"n": [1, {"m": null}]}')]),
]


def _stream(parser, text, rng):
    """Feed `text` in random pieces; returns (content, [(name, arguments)], ids)."""
    s = parser.streamer()
    deltas, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        deltas.append(s.feed(text[i:i + n]))
        i += n
    deltas.append(s.finish())
    content, calls = "", {}
    for d in deltas:
        content += d.content or ""
        for tc in d.tool_calls:
            call = calls.setdefault(tc["index"], {"name": None, "args": "", "id": None})
            if "id" in tc:
                assert call["id"] is None, "a call's header comes once"
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            else:
                assert call["id"] is not None, "arguments before the call's name"
            call["args"] += tc["function"].get("arguments", "")
    return content, [(calls[i]["name"], calls[i]["args"]) for i in sorted(calls)]


@pytest.mark.parametrize("family, text, content, calls", [
    ("hermes", *HERMES_TEXTS[0]), ("hermes", *HERMES_TEXTS[1]),
    ("hermes", "<tool_call>\n" + HERMES_TEXTS[2][0] + "\n</tool_call>", None, HERMES_TEXTS[2][2]),
    ("llama3_json", *LLAMA_TEXTS[0]), ("llama3_json", *LLAMA_TEXTS[1]),
])
def test_parse_whole_and_streamed(family, text, content, calls):
    parser = get_tool_parser(family)
    whole = parser.parse(text)
    assert whole.tools_called and whole.content == content
    assert [(c.name, c.arguments) for c in whole.tool_calls] == calls
    for c in whole.tool_calls:
        json.loads(c.arguments)
        assert c.to_openai()["function"] == {"name": c.name, "arguments": c.arguments}
    for seed in range(20):
        got_content, got_calls = _stream(parser, text, random.Random(seed))
        assert got_calls == calls  # the argument deltas concatenate to the whole parse
        assert got_content.strip() == (content or "")


@pytest.mark.parametrize("family, text", [
    ("hermes", "Just an answer, no tools."),
    ("hermes", "Broken <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \n</tool_call>"),
    ("llama3_json", "The weather is fine."),
    ("llama3_json", '{"not_a_call": 1}'),
])
def test_text_without_a_valid_call_is_content(family, text):
    whole = get_tool_parser(family).parse(text)
    assert not whole.tools_called and whole.content == text


def test_streamed_content_holds_back_a_partial_tag():
    s = get_tool_parser("hermes").streamer()
    assert s.feed("Hello <tool").content == "Hello "
    assert s.feed("box> world").content == "<toolbox> world"
    assert not s.feed("").tool_calls


def test_detect_parser_from_template(smollm_tokenizer):
    assert detect_tool_parser("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_tool_parser("<|python_tag|>{{ tools }}") == "llama3_json"
    assert detect_tool_parser(smollm_tokenizer.chat_template) == "hermes"  # rendered by us
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("mistral9")


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
         "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm_tokenizer):
    path = save_tiny_model(str(tmp_path_factory.mktemp("tiny_tools")), tiny_config("llama"),
                           smollm_tokenizer)
    return LLM(path, dtype="float32", kv_cache_memory=16 << 20)


def _forced_answers(llm, prompt: str, guided, n: int) -> list:
    """n sampled answers (seeds 0..n-1) under a tool_choice grammar, each ended by it."""
    outs = llm.generate([prompt] * n,
                        [SamplingParams(temperature=1.0, seed=s, max_tokens=300,
                                        guided_decoding=guided) for s in range(n)],
                        use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
    return [out.outputs[0] for out in outs]


@pytest.mark.parametrize("family", ["hermes", "llama3_json"])
@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", False), ("required", True),
    ({"type": "function", "function": {"name": "add"}}, True),
])
def test_tool_choice_grammar_makes_parsable_calls(llm, family, tool_choice, parallel):
    guided = tool_choice_guided_decoding(TOOLS, tool_choice, parallel, family)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in _forced_answers(llm, "What is the weather in Paris?", guided, 6):
        parsed = get_tool_parser(family).parse(c.text)
        assert parsed.tools_called, c.text
        if not parallel or isinstance(tool_choice, dict):
            assert len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            if isinstance(tool_choice, dict):
                assert call.name == "add"
            import jsonschema
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        _, streamed = _stream(get_tool_parser(family), c.text, random.Random(0))
        assert streamed == [(t.name, t.arguments) for t in parsed.tool_calls]


def _pydantic_tools():
    """What openai.pydantic_function_tool makes of nested models: $defs and #/$defs refs
    (and a recursive one: a reference to the root, '#')."""
    address = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "integer", "minimum": 0,
                                                         "maximum": 99999}},
               "required": ["city", "zip"], "additionalProperties": False}
    lookup = {"type": "object", "$defs": {"Address": address},
              "properties": {"who": {"type": "string", "maxLength": 12},
                             "address": {"$ref": "#/$defs/Address"}},
              "required": ["who", "address"], "additionalProperties": False}
    tree = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 8},
                                             "child": {"anyOf": [{"$ref": "#"},
                                                                 {"type": "null"}]}},
            "required": ["label", "child"], "additionalProperties": False}
    return [{"type": "function", "function": {"name": "lookup", "parameters": lookup}},
            {"type": "function", "function": {"name": "tree", "parameters": tree}}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "lookup"}}])
def test_tools_with_references_keep_them_in_the_calls_grammar(llm, tool_choice):
    """A tool's parameters sit inside the calls' schema, so its '#'-rooted references are
    re-rooted there: forced calls compile and validate against the tool's own schema."""
    import jsonschema
    tools = _pydantic_tools()
    guided = tool_choice_guided_decoding(tools, tool_choice, False, "hermes")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in _forced_answers(llm, "Look it up.", guided, 4):
        (call,) = get_tool_parser("hermes").parse(c.text).tool_calls
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_two_tools_of_one_name_are_refused():
    tools = [TOOLS[0], {"type": "function", "function": {"name": "get_weather",
                                                          "parameters": {"type": "object"}}}]
    with pytest.raises(ValueError, match=r"tools\[1\].function.name 'get_weather' is "
                                         r"tools\[0\]'s too"):
        tool_choice_guided_decoding(tools, "required")


@pytest.mark.parametrize("tool_choice, error", [
    ({"type": "function", "function": {"name": "nope"}}, "nope"),
    ("sometimes", "tool_choice"),
])
def test_bad_tool_choice(tool_choice, error):
    with pytest.raises(ValueError, match=error):
        tool_choice_guided_decoding(TOOLS, tool_choice)
    with pytest.raises(ValueError, match="tools"):
        tool_choice_guided_decoding(None, "required")
    assert tool_choice_guided_decoding(TOOLS, "auto") is None
    assert tool_choice_guided_decoding(TOOLS, "none") is None


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_tools_and_results_render_without_template_support(smollm_tokenizer):
    ids = render_chat_prompt(smollm_tokenizer, CONVERSATION, TOOLS)
    text = smollm_tokenizer.decode(ids)
    assert "<tools>" in text and '"get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text


def test_tools_and_results_go_to_a_template_that_knows_them(smollm_tokenizer):
    template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
        "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}"
        "{% if m.role == 'tool' %}RESULT {{ m.tool_call_id }}: {% endif %}{{ m.content }}\n"
        "{% endfor %}")
    text = smollm_tokenizer.decode(render_chat_prompt(smollm_tokenizer, CONVERSATION, TOOLS,
                                                      chat_template=template,
                                                      add_generation_prompt=False))
    assert "TOOL get_weather\nTOOL add\n" in text
    assert 'CALL get_weather {"city": "Paris", "unit": "c"}' in text  # arguments as an object
    assert 'RESULT call_1: {"temp": 21}' in text
    with pytest.raises(ValueError, match="tool_call_id"):
        render_chat_prompt(smollm_tokenizer, [{"role": "tool", "content": "x"}],
                           chat_template=template)


def test_llm_chat_accepts_tools(llm):
    guided = tool_choice_guided_decoding(TOOLS, "required", False, "hermes")
    out = llm.chat(CONVERSATION + [{"role": "user", "content": "And in Oslo?"}],
                   SamplingParams(temperature=0, max_tokens=300, guided_decoding=guided),
                   use_tqdm=False, tools=TOOLS)[0]
    assert get_tool_parser("hermes").parse(out.outputs[0].text).tools_called
