"""Tool calling on /v1/chat/completions: what a request's `tools` and `tool_choice` mean for
its prompt, its grammar and its answer.

    tool_choice       tools in the prompt   grammar                   calls read from the text
    none              no                    response_format, if any   no: plain content
    auto (default)    yes                   response_format, if any   by the family's parser
    required          yes                   one or more calls         yes (they always parse)
    {named function}  yes                   exactly that call         yes (it always parses)

The family (`--tool-call-parser`, or `auto`: the model's architecture, else the chat
template) decides both the call format the grammar enforces and the parser that reads it back.
A model with no format of its own (Gemma's and Phi's templates) gets a 400 for tools unless
the server names a parser.
"""

from __future__ import annotations

from dataclasses import dataclass

from quire.entrypoints.errors import bad_request, invalid_input
from quire.entrypoints.limits import check_count, check_schema_bytes
from quire.entrypoints.openai_protocol import (
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from quire.entrypoints.tool_calls import (
    DeltaMessage,
    ToolCallStreamer,
    ToolParser,
    auto_tool_parser,
    get_tool_parser,
    tool_choice_guided_decoding,
)
from quire.structured.params import GuidedDecodingParams

TOOL_CALLS = "tool_calls"  # the finish_reason of an answer that calls tools


@dataclass
class ToolUse:
    tools: list[dict] | None = None                # what the chat template gets
    parser: ToolParser | None = None               # reads calls out of the text
    guided: GuidedDecodingParams | None = None     # tool_choice required / named


def parser_name(configured: str, chat_template: str | None,
                architecture: str = "") -> str | None:
    """--tool-call-parser, with `auto` picked by the model's family or the template that
    renders the prompt; None: the model has no tool-call format."""
    if configured == "auto":
        return auto_tool_parser(architecture, chat_template)
    return configured


async def tool_use(serving, req, template: str | None) -> ToolUse:
    """The request's ToolUse; a 400 naming tools or tool_choice for anything wrong."""
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools
                                                                   else "none")
    if not req.tools and choice in ("none", "auto"):
        return ToolUse()
    check_count("tools", req.tools, serving.limits.max_tools, "max-tools")
    info = serving.engine.model_info
    family = parser_name(serving.tool_call_parser, template,
                         info.architecture if info is not None else "")
    if family is None and choice != "none":
        raise bad_request("this model's chat template defines no tool-call format this server "
                          "reads; start the server with --tool-call-parser hermes to have "
                          "tools rendered and read Hermes-style", "tools")
    guided = await serving.pool.run(_grammar, req.tools, choice, req.parallel_tool_calls,
                                    family or "hermes", serving.limits.max_schema_bytes)
    if choice == "none":
        return ToolUse()  # the model answers in words: it isn't even told of the tools
    return ToolUse(req.tools, get_tool_parser(family), guided)


def _grammar(tokenizer, tools, choice, parallel: bool, family: str,
             max_schema_bytes: int) -> GuidedDecodingParams | None:
    """Validates the tools (and compiles-checks their schemas when the grammar needs them):
    in the tokenizer pool, as schemas can be big."""
    if tools is not None:
        check_schema_bytes("tools", tools, max_schema_bytes)
    try:
        return tool_choice_guided_decoding(tools, choice, parallel, family)
    except ValueError as e:  # its errors carry tools or tool_choice
        raise invalid_input(e) from None


# --- answers ----------------------------------------------------------------------------
# An answer that max_tokens cut ("length") keeps that finish_reason, streamed or not: its
# complete calls, and the call the cut interrupted with its arguments as far as they came
# (not JSON; OpenAI's own answer to a cut call), once its name was whole. A whole answer is
# the stream's pieces joined, so both paths read a cut answer with the same streamer.
LENGTH = "length"


def message_parts(use: ToolUse, text: str | None, finish_reason: str | None
                  ) -> tuple[str | None, list[ToolCallOut], str | None]:
    """(content, tool_calls, finish_reason) of a whole answer (`text`: its content part;
    None when it is all reasoning)."""
    if use.parser is None or text is None:
        return text, [], finish_reason
    if finish_reason == LENGTH:
        return _cut_answer(use.parser, text)
    parsed = use.parser.parse(text)
    if not parsed.tools_called:
        return text, [], finish_reason
    calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
             for c in parsed.tool_calls]
    return parsed.content, calls, TOOL_CALLS


def _cut_answer(parser: ToolParser, text: str
                ) -> tuple[str | None, list[ToolCallOut], str]:
    """A cut answer's parts: exactly what its stream sends, joined."""
    streamer = parser.streamer()
    pieces = [streamer.feed(text), streamer.finish()]
    content = "".join(p.content or "" for p in pieces)
    calls: dict[int, dict] = {}
    for piece in (tc for p in pieces for tc in p.tool_calls):
        call = calls.setdefault(piece["index"], {"arguments": ""})
        if "id" in piece:
            call["id"], call["name"] = piece["id"], piece["function"]["name"]
        call["arguments"] += piece["function"].get("arguments") or ""
    if not calls:
        return content, [], LENGTH
    out = [ToolCallOut(id=c["id"], function=FunctionCallOut(name=c["name"],
                                                            arguments=c["arguments"]))
           for _, c in sorted(calls.items())]
    return (content if content.strip() else None), out, LENGTH


class ToolCallDeltas:
    """A streamed answer's tool calls, per choice: text deltas in, content and
    delta.tool_calls pieces out (the name first, then the arguments as they arrive)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.streamers: dict[int, ToolCallStreamer] = {}

    def feed(self, index: int, text: str, finish_reason: str | None
             ) -> tuple[str | None, list[DeltaToolCall] | None, str | None]:
        s = self.streamers.setdefault(index, self.parser.streamer())
        delta = s.feed(text)
        if finish_reason is not None:  # nothing more comes: release what was held back
            rest = s.finish()
            delta = DeltaMessage((delta.content or "") + (rest.content or "") or None,
                                 delta.tool_calls + rest.tool_calls)
            if s.tools_called and finish_reason != LENGTH:
                finish_reason = TOOL_CALLS
        calls = [DeltaToolCall.model_validate(c) for c in delta.tool_calls] or None
        return delta.content, calls, finish_reason
