"""Bad input raises QuireValidationError: still a ValueError with the same readable message,
and it carries the field at fault, so no caller has to read the message to learn it."""

from __future__ import annotations

import argparse

import pytest

from quire import BeamSearchParams, EngineArgs, LoRARequest, QuireValidationError, SamplingParams
from quire.entrypoints.engine_args import add_engine_flags, engine_args_from
from quire.entrypoints.tool_calls.grammar import tool_choice_guided_decoding
from quire.structured.params import GuidedDecodingParams
from quire.structured.request_formats import guided_decoding_from_request

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_sampling_params_raise_a_typed_error_that_is_still_a_value_error():
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=-1)
    assert isinstance(e.value, QuireValidationError)
    assert e.value.field == "temperature" and e.value.value == -1
    assert str(e.value) == e.value.message == \
        "temperature must be a finite number >= 0, got -1"


CHECKS = [
    (lambda: SamplingParams(top_p=0), "top_p", "(0, 1]"),
    (lambda: SamplingParams(repetition_penalty=0), "repetition_penalty", "> 0"),
    # infinite values divide masks into NaN (an infinite temperature made top_k and grammars
    # no-ops): refused as the server refuses them
    (lambda: SamplingParams(temperature=float("inf")), "temperature", "a finite number"),
    (lambda: SamplingParams(repetition_penalty=float("inf")), "repetition_penalty", "finite"),
    (lambda: BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("-inf")),
     "length_penalty", "a finite number"),
    (lambda: SamplingParams(stop=["a", ""]), "stop", "non-empty strings"),
    (lambda: SamplingParams(stop_token_ids=[-1]), "stop_token_ids", "non-negative"),
    (lambda: SamplingParams(ignore_eos="yes"), "ignore_eos", "a boolean"),
    (lambda: SamplingParams(min_tokens=9, max_tokens=4), "min_tokens", "<= max_tokens (4)"),
    (lambda: SamplingParams(guided_decoding={"json": {}}), "guided_decoding",
     "GuidedDecodingParams"),
    (lambda: BeamSearchParams(beam_width=0, max_tokens=4), "beam_width", ">= 1"),
    (lambda: BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos", "a boolean"),
    (lambda: EngineArgs(block_size=24), "block_size", "power of two"),
    (lambda: EngineArgs(dtype="float8"), "dtype", "one of"),
    (lambda: EngineArgs(kv_cache_memory_fraction=0.0), "kv_cache_memory_fraction",
     "(0, 1]"),
    (lambda: EngineArgs(preemption_mode="swap", swap_space=0), "swap_space", "> 0 bytes"),
    (lambda: EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras",
     ">= max_loras (4)"),
    (lambda: EngineArgs(lora_modules={"a": "/x"}), "lora_modules", "enable_lora"),
    (lambda: LoRARequest("a", 0, "/x"), "lora_request", ">= 1"),
    (lambda: GuidedDecodingParams(choice=[]), "choice", "non-empty list"),
    (lambda: GuidedDecodingParams(regex="a", choice=["a"]), "choice", "exactly one"),
    (lambda: GuidedDecodingParams(regex="[a-z"), "regex", "regex"),
    (lambda: guided_decoding_from_request({"response_format": {"type": "xml"}}),
     "response_format", "'json_schema'"),
    (lambda: guided_decoding_from_request({"response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}),
     "response_format", "response_format.json_schema.schema"),
    (lambda: guided_decoding_from_request({"guided_json": "{not json"}), "guided_json",
     "not valid JSON"),
    (lambda: guided_decoding_from_request({"structured_outputs": {"xml": "a"}}),
     "structured_outputs", "allowed"),
    (lambda: guided_decoding_from_request({"structured_outputs": {
        "regex": "a", "disable_any_whitespace": "no"}}), "structured_outputs", "a boolean"),
    (lambda: guided_decoding_from_request({"response_format": {"type": "json_object"},
                                           "guided_regex": "a"}), "guided_regex", "once"),
    (lambda: tool_choice_guided_decoding([{"type": "function"}], "required"), "tools",
     "tools[0].function.name"),
    (lambda: tool_choice_guided_decoding(TOOLS, {"type": "function",
                                                 "function": {"name": "g"}}),
     "tool_choice", "'g'"),
    (lambda: tool_choice_guided_decoding(TOOLS, "required", parser="openai"), "tool_choice",
     "tool_choice 'auto'"),
    (lambda: tool_choice_guided_decoding([{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string", "format": "no-such-format"}}}],
        "required"), "tools", "no-such-format"),
]


@pytest.mark.parametrize("make,field,allowed", CHECKS, ids=[f"{f}-{a}" for _, f, a in CHECKS])
def test_each_check_carries_its_field(make, field, allowed):
    with pytest.raises(QuireValidationError) as e:
        make()
    assert e.value.field == field, (e.value.field, str(e.value))
    assert allowed in str(e.value)


def test_a_bad_flag_is_named_as_the_flag():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    with pytest.raises(QuireValidationError) as e:
        engine_args_from(parser.parse_args(["--block-size", "24"]), None)
    assert e.value.field == "block_size"
    assert str(e.value).startswith("--block-size: block_size must be a power of two")
