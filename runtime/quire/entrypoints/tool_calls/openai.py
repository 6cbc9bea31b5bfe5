"""gpt-oss's tool calls (harmony), as the `openai_gptoss` reasoning parser leaves them in the
content: `<|channel|>commentary to=functions.<name><|message|><JSON arguments><|end|>`, the
`<|end|>` missing when the call ended generation (`<|call|>`). Content is the text before the
first call (a preamble, or the final answer); text after a call is dropped."""

from __future__ import annotations

import json

from quire.entrypoints.reasoning.openai_gptoss import END, MESSAGE, TOOL_CALL_OPEN
from quire.entrypoints.tool_calls.base import ToolCall, ToolParser
from quire.entrypoints.tool_calls.hermes import _hold_prefix


class OpenAIToolParser(ToolParser):
    name = "openai"

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        first = text.find(TOOL_CALL_OPEN)
        if first < 0:
            return (text if final else _hold_prefix(text, TOOL_CALL_OPEN)), []
        bodies, i = [], first
        while i >= 0:
            end = text.find(END, i)
            if end < 0:
                bodies.append(text[i:])
                break
            bodies.append(text[i:end + len(END)])
            i = text.find(TOOL_CALL_OPEN, end)
        return text[:first], bodies

    def _fields(self, body: str):
        """(the function's name once its header is whole, (arguments start, end or None))."""
        m = body.find(MESSAGE)
        if m < 0:
            return None, None
        end = body.find(END, m)
        return body[len(TOOL_CALL_OPEN):m], (m + len(MESSAGE), None if end < 0 else end)

    def _whole_call(self, body: str) -> ToolCall | None:
        name, span = self._fields(body)
        if not name:
            return None
        start, end = span
        arguments = body[start:end if end is not None else len(body)]
        try:
            if not isinstance(json.loads(arguments), dict):
                return None
        except ValueError:
            return None
        return ToolCall(name, arguments)
