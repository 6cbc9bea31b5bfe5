"""Finding JSON values' spans in text that may still be arriving (a streamed tool call).

Spans, not parsed values: a tool call's `arguments` string is the model's own text of the
arguments object, so the streamed pieces and the whole-text parse are the same characters.
"""

from __future__ import annotations

import re

_WS = " \t\r\n"
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None while incomplete."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _SCALAR.match(text, i)
    if m is None or m.end() == len(text):  # a number may go on; a literal may be cut
        return None
    return m.end()


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def object_fields(text: str, i: int = 0):
    """The fields of the JSON object starting at text[i] (after whitespace), as far as they
    have arrived: ({key: (value_start, value_end or None)}, end of the object or None)."""
    fields: dict[str, tuple[int, int | None]] = {}
    i = skip_ws(text, i)
    if i >= len(text) or text[i] != "{":
        return fields, None
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return fields, None
        if text[i] == "}":
            return fields, i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return fields, None  # not JSON: leave it to the whole-text parse
        key_end = _string_end(text, i)
        if key_end is None:
            return fields, None
        key = _loads_str(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return fields, None
        start = skip_ws(text, i + 1)
        if start >= len(text):
            return fields, None
        end = value_end(text, start)
        fields[key] = (start, end)
        if end is None:
            return fields, None
        i = end


def _loads_str(s: str) -> str:
    import json
    try:
        return json.loads(s)
    except ValueError:
        return s[1:-1]
