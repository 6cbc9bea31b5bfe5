"""OpenAI response_format and vLLM's guided_* / structured_outputs fields become one
GuidedDecodingParams; every error names the field (the HTTP layer's 400)."""

from __future__ import annotations

import pytest

from quire.structured import GuidedDecodingParams
from quire.structured.request_formats import (
    from_guided_fields,
    from_response_format,
    from_structured_outputs,
    guided_decoding_from_request,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_response_format_kinds():
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).kind == "json_object"
    g = from_response_format({"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}})
    assert g == GuidedDecodingParams(json=SCHEMA)
    assert from_response_format({"type": "json_schema",
                                 "json_schema": {"name": "any"}}).kind == "json_object"


def test_vllm_guided_fields():
    assert from_guided_fields({}) is None
    assert from_guided_fields({"guided_json": SCHEMA}).kind == "json"
    assert from_guided_fields({"guided_json": '{"type": "string"}'}).kind == "json"
    assert from_guided_fields({"guided_regex": "[0-9]+"}).regex == "[0-9]+"
    assert from_guided_fields({"guided_choice": ["x", "y"]}).choice == ["x", "y"]
    assert from_guided_fields({"guided_grammar": 'root ::= "a"'}).kind == "grammar"
    g = from_guided_fields({"guided_json": SCHEMA, "disable_any_whitespace": False})
    assert g.disable_any_whitespace is False


def test_structured_outputs_object():
    assert from_structured_outputs({"json": SCHEMA}).kind == "json"
    assert from_structured_outputs({"choice": ["a"]}).kind == "choice"
    assert from_structured_outputs({"json_object": True}).kind == "json_object"


@pytest.mark.parametrize("call, field", [
    (lambda: from_response_format({"type": "xml"}), "response_format.type"),
    (lambda: from_response_format({"type": "json_schema"}), "response_format.json_schema"),
    (lambda: from_response_format({"type": "json_schema", "json_schema": {
        "schema": {"type": "array", "uniqueItems": True}}}), "uniqueItems"),
    (lambda: from_response_format("json"), "response_format"),
    (lambda: from_guided_fields({"guided_regex": "(", "guided_choice": ["a"]}), "only one"),
    (lambda: from_guided_fields({"guided_regex": "a(b"}), "guided_regex"),
    (lambda: from_guided_fields({"guided_choice": "abc"}), "guided_choice"),
    (lambda: from_guided_fields({"guided_json": "{nope"}), "guided_json"),
    (lambda: from_structured_outputs({"regex": "a", "choice": ["b"]}), "exactly one"),
    (lambda: from_structured_outputs({"structural_tag": "x"}), "structural_tag"),
    (lambda: guided_decoding_from_request({"response_format": {"type": "json_object"},
                                           "guided_regex": "a"}), "guided_regex: give"),
])
def test_errors_name_the_field(call, field):
    with pytest.raises(ValueError, match=field.replace("*", r"\*").replace(".", r"\.")):
        call()


def test_one_request_body():
    assert guided_decoding_from_request({"prompt": "x"}) is None
    assert guided_decoding_from_request({"guided_choice": ["a", "b"]}).kind == "choice"
    assert guided_decoding_from_request(
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    ).kind == "json"
