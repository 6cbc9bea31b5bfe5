"""Tool parsers by name (`--tool-call-parser`), and which one a chat template implies."""

from __future__ import annotations

from quire.entrypoints.tool_calls.base import ToolParser
from quire.entrypoints.tool_calls.hermes import HermesToolParser
from quire.entrypoints.tool_calls.llama3_json import PYTHON_TAG, Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
                         f"got {name!r}") from None


def detect_tool_parser(chat_template: str | None) -> str:
    """The family a template's tool format belongs to. A template that knows no tools (as
    SmolLM2's) gets tools rendered Hermes-style by render.py, so it parses as Hermes too."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if PYTHON_TAG in template or "Environment: ipython" in template or (
            '"parameters"' in template and "tools" in template):
        return "llama3_json"
    return "hermes"
