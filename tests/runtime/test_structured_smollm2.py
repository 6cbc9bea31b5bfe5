"""The default model (SmolLM2-135M-Instruct, GGUF) answers in JSON that validates against a
nested schema, with sampling on, through its chat template; and calls a tool when required."""

from __future__ import annotations

import json

import jsonschema

from quire import SamplingParams
from quire.entrypoints.tool_calls import get_tool_parser, tool_choice_guided_decoding
from quire.structured.request_formats import from_response_format

from runtime_helpers import assert_no_blocks_in_use

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 30},
                                   "country": {"type": "string", "maxLength": 30}},
                    "required": ["city", "country"], "additionalProperties": False},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                    "maxItems": 3},
    },
    "required": ["name", "age", "address", "hobbies"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a fictional person as JSON.",
           "Give me a JSON profile of a chef from Lyon.",
           "Invent a student who likes chess; answer in JSON."]


def test_smollm2_json_schema_output_validates(smollm):
    guided = from_response_format({"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": PERSON}})
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = smollm.chat(conversations,
                       [SamplingParams(temperature=0.7, seed=s, max_tokens=160,
                                       guided_decoding=guided) for s in range(len(PROMPTS))],
                       use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert_no_blocks_in_use(smollm)


def test_smollm2_required_tool_call_parses(smollm):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 30}},
                       "required": ["city"], "additionalProperties": False}}}]
    guided = tool_choice_guided_decoding(tools, "required", parallel_tool_calls=False)
    out = smollm.chat([{"role": "user", "content": "What's the weather in Paris?"}],
                      SamplingParams(temperature=0, max_tokens=80, guided_decoding=guided),
                      use_tqdm=False, tools=tools)[0]
    parsed = get_tool_parser("hermes").parse(out.outputs[0].text)
    assert parsed.tools_called and parsed.tool_calls[0].name == "get_weather"
    assert isinstance(json.loads(parsed.tool_calls[0].arguments)["city"], str)
