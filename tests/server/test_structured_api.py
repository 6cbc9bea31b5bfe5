"""Structured output through the HTTP API, with the official openai client against `quire
serve` on the default model: response_format (json_schema, json_object) on chat and
completions, vLLM's guided_* and structured_outputs extra-body fields, 400s naming the field,
and the grammar metrics. Schemas bound every string and number, so answers end quickly."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import pydantic
import pytest
import requests
from smollm_fixtures import client, srv  # noqa: F401 (fixtures)

from server_harness import SMOLLM_NAME, metric, metrics_of

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "country": {"enum": ["France", "Japan", "Peru", "Other"]}},
                    "required": ["city", "country"], "additionalProperties": False},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12},
                    "maxItems": 2},
    },
    "required": ["name", "age", "address", "hobbies"],
    "additionalProperties": False,
}
SUBJECTS = ["a chef from Lyon", "a student who likes chess", "a retired pilot", "a painter",
            "a young doctor", "a fisherman in Peru", "a violinist", "a baker", "an astronaut",
            "a gardener", "a taxi driver in Tokyo", "a librarian", "a swimmer", "a poet",
            "a carpenter", "a nurse", "a game designer", "a farmer", "a judge", "a sailor"]
MSG = [{"role": "user", "content": "Say hello."}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _person(client, i: int):
    return client.chat.completions.create(
        model=SMOLLM_NAME, temperature=0.8, seed=i, max_tokens=160,
        messages=[{"role": "user", "content": f"Describe {SUBJECTS[i]} as a JSON object."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})


def test_json_schema_answers_validate_for_20_sampled_prompts(client):
    with ThreadPoolExecutor(len(SUBJECTS)) as pool:  # batched together in the engine
        answers = list(pool.map(lambda i: _person(client, i), range(len(SUBJECTS))))
    texts = set()
    for r in answers:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.add(choice.message.content)
    assert len(texts) > 10  # sampling is on: different prompts and seeds, different people


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]
    population_millions: int = pydantic.Field(ge=0, le=100)


def test_parse_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=SMOLLM_NAME, response_format=City, temperature=0, max_tokens=60,
              messages=[{"role": "user", "content": "Tell me about Paris, as JSON."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_json_object(client):
    r = client.chat.completions.create(
        model=SMOLLM_NAME, temperature=0, max_tokens=80, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a small JSON object about a cat."}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object's beginning
        assert r.choices[0].message.content.startswith("{")


def test_completions_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0,
                                                              "maximum": 9}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    r = client.completions.create(
        model=SMOLLM_NAME, prompt="Is Paris in France? Answer in JSON:", max_tokens=40,
        temperature=0.8, seed=3, n=2,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "a", "schema": schema}}})
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)


def test_guided_choice_regex_and_structured_outputs(client):
    r = client.chat.completions.create(
        model=SMOLLM_NAME, messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5, temperature=0.8, seed=1, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(
        model=SMOLLM_NAME, prompt="A date: ", max_tokens=20, temperature=0.8, seed=2,
        extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].text)
    r = client.completions.create(
        model=SMOLLM_NAME, prompt="Pick a color:", max_tokens=5, temperature=0,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue")


def test_streamed_json_schema_joins_to_valid_json(client):
    chunks = client.chat.completions.create(
        model=SMOLLM_NAME, temperature=0.8, seed=5, max_tokens=160, stream=True,
        messages=[{"role": "user", "content": "Describe a pianist as a JSON object."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


# --- bad input: 400 in OpenAI's shape, naming the field (and what is unsupported) ---------
BIG_SCHEMA = {"type": "object", "properties": {f"field_{i:05d}": {"type": "string"}
                                               for i in range(3000)}}
ERRORS = [
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "unevaluatedProperties": False}}}},
     "response_format", "unevaluatedProperties"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}},
     "response_format", "no-such-format"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format", "type"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"schema": BIG_SCHEMA}}},
     "response_format", "max-schema-bytes"),
    (COMPLETIONS, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "unevaluatedProperties": False}}}},
     "response_format", "unevaluatedProperties"),
    (COMPLETIONS, {"guided_regex": "[a-z"}, "guided_regex", "regex"),
    (COMPLETIONS, {"guided_json": "{not json"}, "guided_json", "JSON"),
    (COMPLETIONS, {"guided_choice": []}, "guided_choice", "choice"),
    (COMPLETIONS, {"guided_grammar": "start: (((("}, "guided_grammar", "grammar"),
    (COMPLETIONS, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "only one"),
    (CHAT, {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "once"),
    (COMPLETIONS, {"structured_outputs": {"xml": "a"}}, "structured_outputs", "xml"),
    # specs no text matches: found when compiled against the tokenizer, before the request
    # runs (they came back 200 with an empty answer that does not match them)
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#"}}}}, "response_format", "no text matches"),
    (CHAT, {"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                            "$ref": "#/$defs/a"}}, "guided_json", "no text matches"),
    (COMPLETIONS, {"guided_regex": "[^\\s\\S]"}, "guided_regex", "no text matches"),
]


@pytest.mark.parametrize("path,extra,param,word", ERRORS,
                         ids=[f"{p.rsplit('/', 1)[1]}-{w}" for p, _, _, w in ERRORS])
def test_bad_structured_output_is_400_naming_the_field(srv, path, extra, param, word):
    body = {"max_tokens": 5, **extra}
    body.update({"messages": MSG} if path == CHAT else {"prompt": "hi"})
    r = requests.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and word in err["message"], err


def test_grammar_metrics_are_exported(srv, client):
    before = metrics_of(srv)
    client.completions.create(model=SMOLLM_NAME, prompt="Yes or no?", max_tokens=3,
                              extra_body={"guided_choice": ["yes", "no"]})
    after = metrics_of(srv)
    count = "quire:structured_output_requests_total"
    assert metric(after, count) >= metric(before, count) + 1
    assert metric(after, "quire:grammar_mask_time_seconds_count") > \
        metric(before, "quire:grammar_mask_time_seconds_count")
    assert metric(after, "quire:grammar_mask_time_seconds_sum") > 0
