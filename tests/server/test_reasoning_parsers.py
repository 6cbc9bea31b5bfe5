"""Reasoning parsers without a server: whole answers split as vLLM's parsers split them, every
way of cutting an answer into deltas giving the same pieces (tags cut anywhere, or whole as one
token), the start state from the prompt and enable_thinking, tool calls read from the content
part only, the tool parser `auto` picks per family, and the serve flags' exit-2 errors."""

from __future__ import annotations

import itertools

import pytest

from quire.entrypoints.chat_reasoning import ReasoningUse, split_answer
from quire.entrypoints.chat_run import ChatChunks
from quire.entrypoints.chat_tools import ToolUse, message_parts
from quire.entrypoints.cli import main
from quire.entrypoints.errors import OpenAIError
from quire.entrypoints.limits import ServerLimits, check_chat_template_kwargs
from quire.entrypoints.reasoning import REASONING_PARSERS, get_reasoning_parser
from quire.entrypoints.tool_calls import auto_tool_parser, get_tool_parser
from quire.outputs import CompletionOutput
from quire.sampling_params import SamplingParams

QWEN3 = get_reasoning_parser("qwen3")
R1 = get_reasoning_parser("deepseek_r1")

# (answer, thinking at the start) -> (reasoning_content, content)
CASES = [
    ("<think>\nLet me see.\n</think>\n\nYes.", True, ("\nLet me see.\n", "\n\nYes.")),
    ("Let me see.</think>Yes.", True, ("Let me see.", "Yes.")),          # <think> in prompt
    ("\n<think>a</think>b", True, ("\na", "b")),                         # leading whitespace
    ("a</think>b</think>c", True, ("a", "b</think>c")),                  # the first one ends it
    ("a<think>b</think>c", True, ("a<think>b", "c")),                    # not leading: kept
    ("</think>Yes.", True, (None, "Yes.")),
    ("<think>a</think>", True, ("a", None)),
    ("still thinking</thi", True, ("still thinking</thi", None)),        # cut off: reasoning
    ("<thin", True, ("<thin", None)),
    ("</think ", True, ("</think ", None)),
    ("", True, (None, None)),
    ("<think>a</think>b", False, (None, "<think>a</think>b")),           # thinking off
    ("plain", False, (None, "plain")),
]


def _stream(parser, pieces, thinking):
    s = parser.streamer(thinking)
    reasoning = content = ""
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    for d in deltas:
        reasoning += d.reasoning or ""
        content += d.content or ""
    return (reasoning or None, content or None), deltas


def _cuts(text: str, k: int):
    """Every way to cut `text` into k + 1 pieces (some empty)."""
    for points in itertools.combinations_with_replacement(range(len(text) + 1), k):
        edges = [0, *points, len(text)]
        yield [text[a:b] for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("parser", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text, thinking, expected", CASES)
def test_whole_and_every_streamed_cut_split_the_same(parser, text, thinking, expected):
    whole = parser.extract(text, thinking)
    assert (whole.reasoning, whole.content) == expected
    for pieces in itertools.chain([list(text)], _cuts(text, 1), _cuts(text, 2)):
        assert _stream(parser, pieces, thinking)[0] == expected, pieces


def test_tags_as_single_token_deltas():
    tokens = ["<think>", "\n", "Hmm", " ok", "\n", "</think>", "\n\n", "Yes", "."]
    (reasoning, content), deltas = _stream(QWEN3, tokens, True)
    assert (reasoning, content) == ("\nHmm ok\n", "\n\nYes.")
    # nothing is held back longer than it must be: each token's text comes out with it
    assert [d.reasoning for d in deltas[:6]] == [None, "\n", "Hmm", " ok", "\n", None]
    assert [d.content for d in deltas[6:9]] == ["\n\n", "Yes", "."]
    assert "</think>" not in (reasoning or "") + (content or "")


def test_a_tag_cut_across_deltas_is_held_until_decided():
    s = QWEN3.streamer(True)
    assert (s.feed("abc</th").reasoning, s.held) == ("abc", "</th")
    d = s.feed("ink>x")
    assert (d.reasoning, d.content) == (None, "x")
    s = QWEN3.streamer(True)
    s.feed("a</th")
    d = s.feed("ing")  # not the tag after all: released as reasoning
    assert (d.reasoning, d.content) == ("</thing", None)


def test_the_start_state_comes_from_the_prompt_and_enable_thinking():
    assert QWEN3.starts_thinking("<|im_start|>assistant\n", {})
    assert QWEN3.starts_thinking("<|im_start|>assistant\n<think>\n", {})
    assert not QWEN3.starts_thinking("assistant\n<think>\n\n</think>\n\n", {})
    assert not QWEN3.starts_thinking("<|im_start|>assistant\n", {"enable_thinking": False})
    assert QWEN3.starts_thinking("<|im_start|>assistant\n", {"enable_thinking": True})
    assert QWEN3.starts_thinking("x", {"enable_thinking": 0})  # only false turns it off
    assert R1.starts_thinking("<｜Assistant｜><think>\n", {"enable_thinking": False})
    assert not R1.starts_thinking("<think>\n\n</think>\n\n", {})


def test_unknown_parser_name_names_the_choices():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "openai_gptoss"}
    with pytest.raises(ValueError, match="deepseek_r1, openai_gptoss, qwen3"):
        get_reasoning_parser("qwen")


# --- tool calls come from the content only ------------------------------------------------
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
ANSWER = f"<think>maybe {CALL.replace('f', 'g')}?</think>{CALL}"


def _output(text: str, finish_reason: str | None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=[0], finish_reason=finish_reason)


def test_tool_calls_are_read_from_the_content_whole_and_streamed():
    use = ReasoningUse(QWEN3, True)
    tools = ToolUse(tools=[{}], parser=get_tool_parser("hermes"))
    reasoning, content = split_answer(use, ANSWER)
    content, calls, finish = message_parts(tools, content, "stop")
    assert reasoning == f"maybe {CALL.replace('f', 'g')}?" and content is None
    assert [c.function.name for c in calls] == ["f"] and finish == "tool_calls"

    fmt = ChatChunks("id", "m", SamplingParams(max_tokens=8), tools, use)
    pieces = [ANSWER[i:i + 3] for i in range(0, len(ANSWER), 3)]
    out = None  # the chat format reads only the choice
    deltas = [fmt.choice(0, 0, out, _output(p, "stop" if i == len(pieces) - 1 else None))
              for i, p in enumerate(pieces)]
    deltas = [d.choices[0] for d in deltas if d is not None]
    streamed_reasoning = "".join(d.delta.reasoning_content or "" for d in deltas)
    streamed_calls = [c for d in deltas for c in d.delta.tool_calls or []]
    assert streamed_reasoning == reasoning
    assert not any(d.delta.content for d in deltas)
    assert streamed_calls[0].function.name == "f"
    assert "".join(c.function.arguments or "" for c in streamed_calls) == '{"x": 1}'
    assert deltas[-1].finish_reason == "tool_calls"


def test_an_answer_that_is_all_reasoning_has_no_content_and_no_calls():
    use = ReasoningUse(QWEN3, True)
    tools = ToolUse(tools=[{}], parser=get_tool_parser("hermes"))
    reasoning, content = split_answer(use, f"thinking {CALL}")
    assert message_parts(tools, content, "length") == (None, [], "length")
    assert reasoning == f"thinking {CALL}"


# --- the tool parser `auto` picks ---------------------------------------------------------
GEMMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
                   "{{ m.content }}<end_of_turn>\n{% endfor %}")


@pytest.mark.parametrize("architecture, template, expected", [
    ("Qwen3ForCausalLM", GEMMA3_TEMPLATE, "hermes"),          # the family's own format
    ("Qwen2ForCausalLM", None, "hermes"),
    ("Gemma3ForCausalLM", GEMMA3_TEMPLATE, None),             # its template defines none
    ("Gemma2ForCausalLM", "{% for t in tools %}<tool_call>{% endfor %}", "hermes"),
    ("Phi3ForCausalLM", "<|user|>{{ messages }}<|end|>", None),
    ("LlamaForCausalLM", "<|python_tag|>{{ tools }}", "llama3_json"),
    ("LlamaForCausalLM", GEMMA3_TEMPLATE, "hermes"),          # rendered Hermes-style by us
    ("", None, "hermes"),
])
def test_auto_tool_parser_by_family(architecture, template, expected):
    assert auto_tool_parser(architecture, template) == expected


# --- request and flag errors --------------------------------------------------------------
def test_reserved_chat_template_kwargs_are_refused():
    with pytest.raises(OpenAIError) as e:
        check_chat_template_kwargs({"messages": []}, ServerLimits(), 128)
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs"
    with pytest.raises(OpenAIError) as e:
        check_chat_template_kwargs({"note": "x" * 5000}, ServerLimits(max_prompt_chars=100),
                                   128)
    assert e.value.param == "chat_template_kwargs" and "--max-prompt-chars" in e.value.message
    check_chat_template_kwargs({"enable_thinking": False}, ServerLimits(), 128)


@pytest.mark.parametrize("args, needles", [
    (["--reasoning-parser", "qwen"], ["--reasoning-parser", "qwen3", "deepseek_r1"]),
    (["--default-chat-template-kwargs", "{enable_thinking: false}"],
     ["--default-chat-template-kwargs", "not valid JSON"]),
    (["--default-chat-template-kwargs", "[1]"],
     ["--default-chat-template-kwargs", "JSON object"]),
    (["--default-chat-template-kwargs", '{"tools": []}'],
     ["--default-chat-template-kwargs", "tools"]),
])
def test_bad_serve_flags_exit_2_naming_the_flag(args, needles, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "some-model", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
