"""From the HTTP APIs' spellings to GuidedDecodingParams; pure functions, no HTTP.

OpenAI: `response_format` = {"type": "text"} | {"type": "json_object"} |
{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}.
vLLM extra body: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (and
`guided_whitespace_pattern`-free `disable_any_whitespace`), or the newer
`structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}`.
Every error is a QuireValidationError whose field is the request's (an HTTP 400); its message
starts with the path inside that field.
"""

from __future__ import annotations

from typing import Any

from quire.structured.params import GuidedDecodingParams
from quire.validation import QuireValidationError

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def from_response_format(response_format: dict | None) -> GuidedDecodingParams | None:
    """OpenAI's response_format; None for absent or {"type": "text"}."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise QuireValidationError("response_format", f"response_format must be an object, "
                                   f"got {response_format!r}", response_format)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _build("response_format", "response_format", json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise QuireValidationError(
                "response_format", "response_format.json_schema must be an object with a "
                "'schema'", spec)
        schema = spec.get("schema")
        if schema is None:  # OpenAI allows a missing schema: any JSON object
            return _build("response_format", "response_format.json_schema", json_object=True)
        if not isinstance(schema, dict):
            raise QuireValidationError(
                "response_format", f"response_format.json_schema.schema must be an object, "
                f"got {type(schema).__name__}", schema)
        return _build("response_format", "response_format.json_schema.schema", json=schema)
    raise QuireValidationError(
        "response_format", f"response_format.type must be 'text', 'json_object' or "
        f"'json_schema', got {kind!r}", kind)


def from_guided_fields(body: dict[str, Any]) -> GuidedDecodingParams | None:
    """vLLM's guided_* extra-body fields; None when none is set."""
    given = {f: body[f] for f in GUIDED_FIELDS if body.get(f) is not None}
    if not given:
        return None
    if len(given) > 1:
        second = sorted(given)[1]
        raise QuireValidationError(
            second, f"{second}: only one of {', '.join(GUIDED_FIELDS)} may be set, got "
            f"{', '.join(sorted(given))}")
    (name, value), = given.items()
    extra = _whitespace(body, "disable_any_whitespace")
    return _build(name, name, **{GUIDED_FIELDS[name]: value}, **extra)


def from_structured_outputs(spec: dict | None) -> GuidedDecodingParams | None:
    """vLLM's newer `structured_outputs` object."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise QuireValidationError("structured_outputs",
                                   f"structured_outputs must be an object, got {spec!r}", spec)
    unknown = set(spec) - set(STRUCTURED_OUTPUT_KINDS) - {"disable_any_whitespace"}
    if unknown:
        raise QuireValidationError(
            "structured_outputs", f"structured_outputs: unsupported field(s) "
            f"{sorted(unknown)}; allowed: {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
            f"disable_any_whitespace")
    kinds = {k: spec[k] for k in STRUCTURED_OUTPUT_KINDS if spec.get(k) not in (None, False)}
    if len(kinds) != 1:
        raise QuireValidationError(
            "structured_outputs", f"structured_outputs must set exactly one of "
            f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {sorted(kinds) or 'none'}")
    return _build("structured_outputs", "structured_outputs", **kinds,
                  **_whitespace(spec, "structured_outputs"))


def guided_decoding_from_request(body: dict[str, Any]) -> GuidedDecodingParams | None:
    """All of a completions / chat request body's spellings; at most one may be used."""
    guided = next((f for f in GUIDED_FIELDS if body.get(f) is not None), "guided_*")
    found = {name: g for name, g in (
        ("response_format", from_response_format(body.get("response_format"))),
        (guided, from_guided_fields(body)),
        ("structured_outputs", from_structured_outputs(body.get("structured_outputs"))),
    ) if g is not None}
    if len(found) > 1:
        second = list(found)[1]
        raise QuireValidationError(
            second, f"{second}: give structured output once, got {', '.join(found)}")
    return next(iter(found.values()), None)


def _whitespace(body: dict, field: str) -> dict:
    """`field`: the request's field that holds disable_any_whitespace."""
    value = body.get("disable_any_whitespace")
    if value is None:
        return {}
    if not isinstance(value, bool):
        raise QuireValidationError(field, f"disable_any_whitespace must be a boolean, got "
                                          f"{value!r}", value)
    return {"disable_any_whitespace": value}


def _build(field: str, where: str, **kwargs) -> GuidedDecodingParams:
    """`field`: the request's field the spec came in; `where`: the path inside it."""
    try:
        return GuidedDecodingParams(**kwargs)
    except ValueError as e:
        raise QuireValidationError(field, f"{where}: {e}") from None
