"""tool_choice = "required" or a named function, enforced with a grammar: the output is one
(or, with parallel_tool_calls, one or more) call(s) in the family's own format, each a JSON
object whose name is a given tool's and whose arguments follow that tool's parameters schema.
So the family's parser always parses it.
"""

from __future__ import annotations

import json

from quire.structured.params import GuidedDecodingParams
from quire.validation import QuireValidationError

# compact JSON inside calls: small models given free whitespace may never close the object
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def validate_tools(tools: list[dict] | None) -> dict[str, dict]:
    """name -> parameters schema; QuireValidationError (field `tools`) naming the bad
    entry."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise QuireValidationError("tools", f"tools must be a list, got {type(tools).__name__}",
                                   tools)
    out = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise QuireValidationError(
                "tools", f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", tool)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise QuireValidationError("tools",
                                       f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise QuireValidationError(
                "tools", f"tools[{i}].function.parameters must be a JSON schema object", params)
        if fn["name"] in out:
            first = next(j for j, t in enumerate(tools) if t["function"]["name"] == fn["name"])
            raise QuireValidationError(
                "tools", f"tools[{i}].function.name {fn['name']!r} is tools[{first}]'s too; "
                "each function needs its own name", fn["name"])
        out[fn["name"]] = params
    return out


def chosen_tools(tools: list[dict] | None, tool_choice) -> dict[str, dict] | None:
    """The tools the output must call from, or None when the model may answer freely
    ("none", "auto", or no tool_choice)."""
    by_name = validate_tools(tools)
    if tool_choice in (None, "none", "auto"):
        return None
    if not by_name:
        raise QuireValidationError("tool_choice", "tool_choice requires tools", tool_choice)
    if tool_choice == "required":
        return by_name
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise QuireValidationError(
                "tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}", tool_choice)
        if name not in by_name:
            raise QuireValidationError(
                "tool_choice", f"tool_choice names function {name!r}, which is not in tools "
                f"({', '.join(by_name)})", tool_choice)
        return {name: by_name[name]}
    raise QuireValidationError(
        "tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named function, "
        f"got {tool_choice!r}", tool_choice)


def tool_choice_guided_decoding(tools: list[dict] | None, tool_choice,
                                parallel_tool_calls: bool = True,
                                parser: str = "hermes") -> GuidedDecodingParams | None:
    """The grammar for tool_choice, or None when none is needed. A named function is called
    exactly once; "required" calls one tool, or several when parallel_tool_calls."""
    tools_by_name = chosen_tools(tools, tool_choice)
    if tools_by_name is None:
        return None
    many = parallel_tool_calls and not isinstance(tool_choice, dict)
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    one = len(tools_by_name) == 1
    schemas = [{"type": "object",
                "properties": {"name": {"const": name}, args_key: _rooted(
                    params, f"#/properties/{args_key}" if one else
                    f"#/anyOf/{i}/properties/{args_key}")},
                "required": ["name", args_key], "additionalProperties": False}
               for i, (name, params) in enumerate(tools_by_name.items())]
    schema = schemas[0] if one else {"anyOf": schemas}
    schema = {**schema, "x-guidance": _COMPACT}
    body = f"body: %json {json.dumps(schema)}\n"
    if parser == "llama3_json":
        start = 'start: body ("; " body)*\n' if many else "start: body\n"
        return _grammar(start + body)
    if parser != "hermes":
        raise QuireValidationError(
            "tool_choice", f"tool_choice 'required' or a named function has no grammar for "
            f"tool_call_parser {parser!r}; use tool_choice 'auto'", tool_choice)
    start = 'start: call ("\\n" call)*\n' if many else "start: call\n"
    call = 'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
    return _grammar(start + call + body)


# keywords whose values are data, not schemas: a "$ref" key there is not a reference
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rooted(schema, at: str):
    """A tool's parameters schema placed at JSON pointer `at` of the calls' schema: its own
    references (#/$defs/..., #, #/properties/...: pydantic's nested models) rewritten to
    point there, since '#' is now the calls' schema's root."""
    if isinstance(schema, list):
        return [_rooted(s, at) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = at + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rooted(value, at)
    return out


def _grammar(text: str) -> GuidedDecodingParams:
    """The calls' grammar; what the grammar library refuses in it is a tool's parameters
    schema (the rest is ours)."""
    try:
        return GuidedDecodingParams(grammar=text)
    except ValueError as e:
        raise QuireValidationError(
            "tools", f"tools: a function's parameters schema: {e}") from None
