"""gpt-oss's harmony format without a server: `openai_gptoss` puts the analysis channel in
reasoning_content, final (and a commentary preamble) in content, and leaves calls to
functions for the `openai` tool parser; every way of cutting an answer into deltas gives the
same fields, and the streamed tool-call pieces join to the whole parse's arguments."""

from __future__ import annotations

import json

import pytest

from quire.entrypoints.chat_reasoning import ReasoningDeltas, ReasoningUse, split_answer
from quire.entrypoints.chat_tools import ToolCallDeltas, ToolUse, message_parts
from quire.entrypoints.reasoning import get_reasoning_parser
from quire.entrypoints.tool_calls import (
    auto_tool_parser,
    get_tool_parser,
    tool_choice_guided_decoding,
)

HARMONY = get_reasoning_parser("openai_gptoss")
USE = ReasoningUse(HARMONY, HARMONY.starts_thinking("<|start|>assistant", {}))
TOOLS = ToolUse(tools=[{"type": "function", "function": {"name": "get_weather"}}],
                parser=get_tool_parser("openai"))
S, E, M, C = "<|start|>assistant", "<|end|>", "<|message|>", "<|channel|>"
ARGS = '{"city": "Paris", "unit": "°C"}'

# answer -> (reasoning_content, content, tool calls [(name, arguments)])
CASES = [
    (f"{C}analysis{M}Let me think.{E}{S}{C}final{M}Paris.",
     ("Let me think.", "Paris.", [])),
    (f"{C}final{M}Just this.", (None, "Just this.", [])),
    (f"{C}analysis{M}Need the weather.{E}{S}{C}commentary to=functions.get_weather "
     f"<|constrain|>json{M}{ARGS}", ("Need the weather.", None, [("get_weather", ARGS)])),
    # the recipient before the channel, a preamble first
    (f"{C}commentary{M}Checking.{E}{S} to=functions.get_weather{C}commentary json{M}{ARGS}",
     (None, "Checking.", [("get_weather", ARGS)])),
    # two calls (the first ended by <|end|>), then the model went on
    (f"{C}commentary to=functions.a{M}{{}}{E}{S}{C}commentary to=functions.b{M}{{\"x\": 1}}",
     (None, None, [("a", "{}"), ("b", '{"x": 1}')])),
    # a built-in tool's call (browser) is reasoning
    (f"{C}analysis to=browser.search{M}{{\"q\": \"x\"}}{E}{S}{C}final{M}Done.",
     ('{"q": "x"}', "Done.", [])),
    (f"{C}analysis{M}cut off while thinking", ("cut off while thinking", None, [])),
    (f"{C}analysis{M}a{E}{S}{C}fin", ("a", None, [])),   # header cut off: nothing shown
    ("no harmony at all", (None, "no harmony at all", [])),
    ("", (None, None, [])),
    # markers' look-alikes in a body are text
    (f"{C}final{M}a <| b |> <|en", (None, "a <| b |> <|en", [])),
]


def _whole(answer):
    reasoning, content = split_answer(USE, answer)
    content, calls, _ = message_parts(TOOLS, content, "stop")
    return reasoning, content, [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.parametrize("answer,want", CASES)
def test_whole_answers(answer, want):
    assert _whole(answer) == want


def _cuts(answer):
    """The answer cut at every pair of places (three deltas), and at each marker whole."""
    n = len(answer)
    for i in range(n + 1):
        for j in range(i, n + 1, max(1, n // 12)):
            yield [answer[:i], answer[i:j], answer[j:]]


@pytest.mark.parametrize("answer,want", CASES)
def test_every_cut_streams_the_same_fields(answer, want):
    for pieces in _cuts(answer):
        reasoning_deltas, tool_deltas = ReasoningDeltas(USE), ToolCallDeltas(TOOLS.parser)
        reasoning, content, calls = "", "", {}
        finish = None
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            thought, text = reasoning_deltas.feed(0, piece, last)
            reasoning += thought or ""
            text, deltas, finish = tool_deltas.feed(0, text, "stop" if last else None)
            content += text or ""
            for d in deltas or []:
                call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                if d.function.name:
                    call["name"] = d.function.name
                call["arguments"] += d.function.arguments or ""
        got = (reasoning or None, content or None,
               [(c["name"], c["arguments"]) for _, c in sorted(calls.items())])
        assert got == want, pieces
        assert finish == ("tool_calls" if want[2] else "stop")


def test_arguments_are_json_and_calls_need_a_name():
    _, _, calls = _whole(f"{C}commentary to=functions.f{M}{ARGS}")
    assert json.loads(calls[0][1]) == {"city": "Paris", "unit": "°C"}
    # arguments that are not a JSON object: no call, the text stays content
    bad = f"{C}commentary to=functions.f{M}not json"
    assert _whole(bad)[2] == []


def test_auto_picks_the_openai_tool_parser_for_gpt_oss_and_refuses_required():
    assert auto_tool_parser("GptOssForCausalLM", None) == "openai"
    with pytest.raises(ValueError, match="tool_choice 'required' or a named function has no "
                                         "grammar for tool_call_parser 'openai'"):
        tool_choice_guided_decoding(TOOLS.tools, "required", True, "openai")
    assert HARMONY.needs_special_tokens
