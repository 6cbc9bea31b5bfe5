"""Llama 3.x JSON-style calls: the whole reply is one or more JSON objects, optionally after
<|python_tag|>, separated by ';':

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A reply that does not start with '{' is plain content.
"""

from __future__ import annotations

from quire.entrypoints.tool_calls.base import ToolParser
from quire.entrypoints.tool_calls.json_scan import skip_ws, value_end

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    argument_keys = ("parameters", "arguments")

    def split(self, text: str, final: bool) -> tuple[str, list[str]]:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        rest = text[i:]
        if not rest or (not final and PYTHON_TAG.startswith(rest)):
            return ("" if not final else text), []  # undecided: hold it
        if rest[0] != "{":
            return text, []
        bodies = []
        while i < len(text):
            end = value_end(text, i)
            if end is None:
                bodies.append(text[i:])
                break
            bodies.append(text[i:end])
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            elif i < len(text):
                break  # trailing text after the calls is dropped
        return "", bodies
