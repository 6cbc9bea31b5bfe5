"""/v1/responses through the official openai client against `quire serve` on the default
model (SmolLM2): plain, streamed, with tools, and a second turn by previous_response_id, each
equal to the chat completion of the same conversation at temperature 0; the stream's event
sequence; stored responses (GET, store: false, unknown ids are 404 in OpenAI's shape); and a
400 naming the field for every bad field, never a 500."""

from __future__ import annotations

import json

import openai
import pytest
import requests
from smollm_fixtures import client, srv  # noqa: F401 (fixtures)

from server_harness import SMOLLM_NAME

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
MAX = 24


def _function(name: str, description: str, properties: dict) -> dict:
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties,
                           "required": list(properties), "additionalProperties": False}}


WEATHER = _function("get_weather", "Current weather in a city",
                    {"city": {"type": "string", "maxLength": 20}})
TIME = _function("get_time", "Current time in a timezone",
                 {"timezone": {"type": "string", "maxLength": 20}})
RESPONSES_TOOLS = [{"type": "function", **WEATHER}, {"type": "function", **TIME}]
CHAT_TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
WEATHER_ASK = "What's the weather like in Paris?"


def _chat(client, messages, max_tokens=MAX, **kwargs):
    return client.chat.completions.create(model=SMOLLM_NAME, messages=messages,
                                          max_tokens=max_tokens, temperature=0, **kwargs)


def _respond(client, **kwargs):
    kwargs.setdefault("max_output_tokens", MAX)
    return client.responses.create(model=SMOLLM_NAME, temperature=0, **kwargs)


def test_plain_response_equals_the_chat_completion(client):
    r = _respond(client, input=QUESTION, instructions=INSTRUCTIONS)
    c = _chat(client, [{"role": "system", "content": INSTRUCTIONS},
                       {"role": "user", "content": QUESTION}])
    assert r.output_text and r.output_text == c.choices[0].message.content
    assert r.object == "response" and r.id.startswith("resp_") and r.model == SMOLLM_NAME
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.status == ("completed" if c.choices[0].finish_reason == "stop" else "incomplete")
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == INSTRUCTIONS and r.max_output_tokens == MAX


def test_input_items_equal_the_same_chat_messages(client):
    items = [{"role": "developer", "content": INSTRUCTIONS},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": QUESTION}]}]
    r = _respond(client, input=items)
    c = _chat(client, [{"role": "developer", "content": INSTRUCTIONS},
                       {"role": "user", "content": QUESTION}])
    assert r.output_text == c.choices[0].message.content


def test_streamed_response_is_the_event_sequence_and_the_same_text(client):
    events = list(_respond(client, input=QUESTION, stream=True))
    c = _chat(client, [{"role": "user", "content": QUESTION}])
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.completed" if c.choices[0].finish_reason == "stop"
                          else "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"} and len(types) > 9
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == c.choices[0].message.content
    done = events[-4]
    assert done.text == text and events[-2].item.content[0].text == text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == c.usage.completion_tokens
    assert events[0].response.status == "in_progress" and not events[0].response.output
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {events[2].item.id}


def test_max_output_tokens_cut_is_incomplete(client):
    r = _respond(client, input=QUESTION, max_output_tokens=3)
    c = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=3)
    assert c.choices[0].finish_reason == "length"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == c.choices[0].message.content and r.usage.output_tokens == 3
    events = list(_respond(client, input=QUESTION, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == r.output_text


def test_top_logprobs_equal_the_chat_logprobs(client):
    r = _respond(client, input=QUESTION, top_logprobs=2, max_output_tokens=6)
    c = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=6, logprobs=True,
              top_logprobs=2)
    want = [(t.token, round(t.logprob, 5), [(x.token, round(x.logprob, 5))
                                            for x in t.top_logprobs])
            for t in c.choices[0].logprobs.content]
    got = [(t.token, round(t.logprob, 5), [(x.token, round(x.logprob, 5))
                                           for x in t.top_logprobs])
           for t in r.output[0].content[0].logprobs]
    assert got == want and len(got) == 6
    events = list(_respond(client, input=QUESTION, top_logprobs=2, max_output_tokens=6,
                           stream=True))
    streamed = [(t.token, round(t.logprob, 5)) for e in events
                if e.type == "response.output_text.delta" for t in e.logprobs]
    assert streamed == [w[:2] for w in want]


def _calls_of_chat(c) -> list[tuple[str, str]]:
    return [(t.function.name, t.function.arguments) for t in c.choices[0].message.tool_calls]


def _calls_of(response) -> list[tuple[str, str]]:
    return [(i.name, i.arguments) for i in response.output if i.type == "function_call"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_function_calls_equal_the_chat_completions(client, choice):
    chat_choice = choice if isinstance(choice, str) else {
        "type": "function", "function": {"name": choice["name"]}}
    c = _chat(client, [{"role": "user", "content": WEATHER_ASK}], max_tokens=80,
              tools=CHAT_TOOLS, tool_choice=chat_choice, parallel_tool_calls=False)
    r = _respond(client, input=WEATHER_ASK, tools=RESPONSES_TOOLS, tool_choice=choice,
                 parallel_tool_calls=False, max_output_tokens=80)
    assert _calls_of(r) == _calls_of_chat(c) and len(_calls_of(r)) == 1
    assert [i.type for i in r.output] == ["function_call"]
    assert r.output[0].call_id and r.status == "completed"
    if isinstance(choice, dict):
        assert r.output[0].name == "get_time"
    events = list(_respond(client, input=WEATHER_ASK, tools=RESPONSES_TOOLS, tool_choice=choice,
                           parallel_tool_calls=False, max_output_tokens=80, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "function_call"
    assert added[0].item.name == r.output[0].name and added[0].item.arguments == ""
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done[0].arguments == r.output[0].arguments
    assert _calls_of(events[-1].response) == _calls_of(r)


def test_second_turn_by_previous_response_id_equals_the_chat_conversation(client):
    first = _respond(client, input=QUESTION, instructions=INSTRUCTIONS)
    second = _respond(client, input="And of Germany?", previous_response_id=first.id)
    # instructions are not carried over to the next turn (OpenAI's rule)
    c = _chat(client, [{"role": "user", "content": QUESTION},
                       {"role": "assistant", "content": first.output_text},
                       {"role": "user", "content": "And of Germany?"}])
    assert second.output_text == c.choices[0].message.content
    assert second.previous_response_id == first.id


def test_a_function_result_continues_the_stored_call(client):
    first = _respond(client, input=WEATHER_ASK, tools=RESPONSES_TOOLS, tool_choice="required",
                     parallel_tool_calls=False, max_output_tokens=80)
    call = first.output[0]
    result = _respond(client, previous_response_id=first.id, tools=RESPONSES_TOOLS,
                      input=[{"type": "function_call_output", "call_id": call.call_id,
                              "output": "sunny, 21 C"}])
    c = _chat(client, [{"role": "user", "content": WEATHER_ASK},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": call.call_id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}]},
                       {"role": "tool", "tool_call_id": call.call_id,
                        "content": "sunny, 21 C"}], tools=CHAT_TOOLS)
    assert result.output_text == (c.choices[0].message.content or "")
    assert _calls_of(result) == [(t.function.name, t.function.arguments)
                                 for t in c.choices[0].message.tool_calls or []]


def test_stored_responses_are_retrieved_and_unknown_ids_are_404(client, srv):
    r = _respond(client, input=QUESTION)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    unstored = _respond(client, input=QUESTION, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    body = requests.post(srv.url + "/v1/responses", timeout=60, json={
        "input": "hi", "previous_response_id": unstored.id}).json()
    assert body["error"]["param"] == "previous_response_id"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "response_not_found"


NO_TEXT = [{"role": "user", "content": [{"type": "input_text"}]}]
BAD_CALL = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "not json"},
            {"type": "function_call_output", "call_id": "c1", "output": "x"}]
BAD_FIELDS = [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": "x" * (16 * 2048 + 1)}, "input"),
    ({"instructions": 5}, "instructions"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "many"}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"top_k": -5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"stop": ["x"] * 100}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"store": "yes"}, "store"),
    ({"previous_response_id": 5}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 5}]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "text"),
    ({"background": True}, "background"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"priority": "high"}, "priority"),
    ({"priority": 1.5}, "priority"),
    ({"priority": 2**40}, "priority"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"reasoning": {"effort": 5}}, "reasoning"),
    ({"include": "everything"}, "include"),
    ({"metadata": {"a": 1}}, "metadata"),
    ({"max_tool_calls": 0}, "max_tool_calls"),
    ({"input": NO_TEXT}, "input"),
    ({"instructions": "Be brief", "input": BAD_CALL}, "input"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS,
                         ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_FIELDS)])
def test_bad_fields_get_400_naming_them(srv, fields, param):
    body = {"model": SMOLLM_NAME, "input": QUESTION, "max_output_tokens": 4, **fields}
    r = requests.post(srv.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    if fields.get("input") == NO_TEXT:  # a known part missing its text: said so, not "unsupported"
        assert "needs its 'text'" in error["message"], error
    if fields.get("input") == BAD_CALL:  # named by its item, not by chat's message
        assert error["message"].startswith("input[0].arguments"), error


def test_unknown_model_is_404_and_priority_is_accepted(srv, client):
    r = requests.post(srv.url + "/v1/responses", timeout=60,
                      json={"model": "nope", "input": QUESTION})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = _respond(client, input=QUESTION, extra_body={"priority": -3})
    assert r.output_text == _respond(client, input=QUESTION).output_text


def test_openapi_declares_the_request_bodies(srv):
    spec = requests.get(srv.url + "/openapi.json", timeout=30).json()
    body = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"]
    ref = body["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    fields = spec["components"]["schemas"][ref]["properties"]
    assert {"input", "instructions", "max_output_tokens", "tools", "previous_response_id",
            "priority"} <= set(fields)
    assert "/v1/messages" in spec["paths"] and "/v1/messages/count_tokens" in spec["paths"]
    json.dumps(spec)


def test_cache_salt_keeps_prefix_cache_hits_apart(client):
    """The prefix cache reports its hits in usage, and a salt shares them only with itself
    (the prompt is several blocks long: the instructions make it so)."""
    ask = {"input": QUESTION, "instructions": INSTRUCTIONS * 4, "max_output_tokens": 2}
    _respond(client, **ask)
    assert _respond(client, **ask).usage.input_tokens_details.cached_tokens >= 16
    salted = _respond(client, **ask, extra_body={"cache_salt": "tenant-7f3"})
    assert salted.usage.input_tokens_details.cached_tokens == 0
    again = _respond(client, **ask, extra_body={"cache_salt": "tenant-7f3"})
    assert again.usage.input_tokens_details.cached_tokens >= 16
