"""From the HTTP APIs' spellings to GuidedDecodingParams; pure functions, no HTTP.

OpenAI: `response_format` = {"type": "text"} | {"type": "json_object"} |
{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}.
vLLM extra body: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (and
`guided_whitespace_pattern`-free `disable_any_whitespace`), or the newer
`structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}`.
Every error is a ValueError whose message starts with the field's name (an HTTP 400).
"""

from __future__ import annotations

from typing import Any

from quire.structured.params import GuidedDecodingParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def from_response_format(response_format: dict | None) -> GuidedDecodingParams | None:
    """OpenAI's response_format; None for absent or {"type": "text"}."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got {response_format!r}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _build("response_format", json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema")
        if schema is None:  # OpenAI allows a missing schema: any JSON object
            return _build("response_format.json_schema", json_object=True)
        if not isinstance(schema, dict):
            raise ValueError(f"response_format.json_schema.schema must be an object, got "
                             f"{type(schema).__name__}")
        return _build("response_format.json_schema.schema", json=schema)
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                     f"got {kind!r}")


def from_guided_fields(body: dict[str, Any]) -> GuidedDecodingParams | None:
    """vLLM's guided_* extra-body fields; None when none is set."""
    given = {f: body[f] for f in GUIDED_FIELDS if body.get(f) is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"{sorted(given)[1]}: only one of {', '.join(GUIDED_FIELDS)} may be "
                         f"set, got {', '.join(sorted(given))}")
    (name, value), = given.items()
    extra = _whitespace(body, name)
    return _build(name, **{GUIDED_FIELDS[name]: value}, **extra)


def from_structured_outputs(spec: dict | None) -> GuidedDecodingParams | None:
    """vLLM's newer `structured_outputs` object."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs must be an object, got {spec!r}")
    unknown = set(spec) - set(STRUCTURED_OUTPUT_KINDS) - {"disable_any_whitespace"}
    if unknown:
        raise ValueError(f"structured_outputs: unsupported field(s) {sorted(unknown)}; allowed: "
                         f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, disable_any_whitespace")
    kinds = {k: spec[k] for k in STRUCTURED_OUTPUT_KINDS if spec.get(k) not in (None, False)}
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs must set exactly one of "
                         f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {sorted(kinds) or 'none'}")
    return _build("structured_outputs", **kinds, **_whitespace(spec, "structured_outputs"))


def guided_decoding_from_request(body: dict[str, Any]) -> GuidedDecodingParams | None:
    """All of a completions / chat request body's spellings; at most one may be used."""
    found = {name: g for name, g in (
        ("response_format", from_response_format(body.get("response_format"))),
        ("guided_*", from_guided_fields(body)),
        ("structured_outputs", from_structured_outputs(body.get("structured_outputs"))),
    ) if g is not None}
    if len(found) > 1:
        raise ValueError(f"{list(found)[1]}: give structured output once, got "
                         f"{', '.join(found)}")
    return next(iter(found.values()), None)


def _whitespace(body: dict, field: str) -> dict:
    value = body.get("disable_any_whitespace")
    if value is None:
        return {}
    if not isinstance(value, bool):
        raise ValueError(f"disable_any_whitespace must be a boolean, got {value!r}")
    return {"disable_any_whitespace": value}


def _build(field: str, **kwargs) -> GuidedDecodingParams:
    try:
        return GuidedDecodingParams(**kwargs)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
