"""Hermes-style calls, as the Qwen2 / Qwen2.5 (and our SmolLM2 fallback) templates ask for:

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first <tool_call>; text between or after calls is dropped.
"""

from __future__ import annotations

from quire.entrypoints.tool_calls.base import ToolParser
from quire.entrypoints.tool_calls.json_scan import skip_ws, value_end

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    argument_keys = ("arguments",)

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        first = text.find(OPEN)
        if first < 0:
            return (text if final else _hold_prefix(text, OPEN)), []
        bodies = []
        i = first
        while i >= 0:
            start = skip_ws(text, i + len(OPEN))
            # the call ends with its JSON object, not at the first </tool_call>: that string
            # may sit inside the arguments
            end = value_end(text, start) if text[start:start + 1] == "{" else None
            if end is None and text[start:start + 1] != "{":
                end = text.find(CLOSE, start)  # not JSON: the whole parse will say so
                end = None if end < 0 else end
            if end is None:
                bodies.append(text[start:])
                break
            bodies.append(text[start:end])
            i = text.find(OPEN, end)
        return text[:first], bodies


def _hold_prefix(text: str, tag: str) -> str:
    """The text less a tail that could be the start of `tag` (sent once it is known not to)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text
