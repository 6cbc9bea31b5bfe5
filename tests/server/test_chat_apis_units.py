"""The parts of /v1/responses and /v1/messages that need no model: the stored responses' bounds
(count and age), the priority hand-over to an engine that schedules by it, the conversations
built from input items and content blocks, the stop-reason mapping and the error shapes."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from quire.entrypoints.anthropic_conversation import chat_messages, stop_reason
from quire.entrypoints.anthropic_protocol import MessagesRequest
from quire.entrypoints.errors import bad_request, error_response, model_not_found
from quire.entrypoints.limits import ServerLimits
from quire.entrypoints.responses_conversation import chat_request, conversation_of
from quire.entrypoints.responses_protocol import ResponsesRequest
from quire.entrypoints.responses_store import ResponseStore, StoredResponse
from quire.entrypoints.serving import Serving


def _stored(text: str) -> StoredResponse:
    return StoredResponse({"id": text}, [{"role": "user", "content": text}])


def test_the_store_forgets_after_its_ttl_and_beyond_its_size():
    now = [0.0]
    store = ResponseStore(max_entries=3, ttl=10.0, clock=lambda: now[0])
    for i in range(4):
        store.put(f"r{i}", _stored(str(i)))
        now[0] += 1
    assert store.get("r0") is None and len(store) == 3  # the oldest went first
    assert store.get("r3").response == {"id": "3"}
    now[0] = 12.5  # r1 (stored at 1) and r2 (at 2) have expired, r3 (at 3) not yet
    assert store.get("r1") is None and store.get("r2") is None and store.get("r3") is not None
    now[0] = 13.0
    assert store.get("r3") is None and len(store) == 0
    store.put("again", _stored("x"))
    assert store.delete("again") and store.get("again") is None


class _Stream:
    def abort(self) -> None:
        pass


def _serving(add_request) -> Serving:
    return Serving(SimpleNamespace(add_request=add_request), ServerLimits())


@pytest.mark.parametrize("takes_priority", [True, False])
def test_priority_reaches_an_engine_that_takes_it(monkeypatch, takes_priority):
    from quire.entrypoints import serving as serving_module
    monkeypatch.setattr(serving_module, "RequestStream", _Stream)
    calls = []
    if takes_priority:
        async def add_request(rid, prompt, params, lora_request=None, cache_salt=None,
                              priority=0):
            calls.append(priority)
            return _Stream()
    else:
        async def add_request(rid, prompt, params, lora_request=None, cache_salt=None):
            calls.append(None)
            return _Stream()
    asyncio.run(_serving(add_request).submit("r", [[1, 2]], object(), priority=-4))
    assert calls == ([-4] if takes_priority else [None])


def test_response_items_become_the_chat_conversation():
    req = ResponsesRequest.model_validate({
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "checking"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"}]})
    before = StoredResponse({}, [{"role": "user", "content": "earlier"},
                                 {"role": "assistant", "content": "yes"}])
    conversation = conversation_of(req, before)
    assert conversation == [
        {"role": "user", "content": "earlier"}, {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function",
             "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    assert before.conversation[-1] == {"role": "assistant", "content": "yes"}  # untouched
    chat = chat_request(req, conversation)
    assert chat.messages[0].role == "system" and chat.messages[0].content == "be brief"
    assert len(chat.messages) == len(conversation) + 1


def test_message_blocks_become_the_chat_conversation():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": ""},
                {"type": "text", "text": "let me see"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": [1]}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "r"}]},
                {"type": "text", "text": "and?"}]}]})
    assert chat_messages(req) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me see", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "f", "arguments": json.dumps({"a": [1]})}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "r"},
        {"role": "user", "content": "and?"}]


@pytest.mark.parametrize(("finish", "stop", "expected"), [
    ("stop", None, ("end_turn", None)),
    ("stop", 2, ("end_turn", None)),            # the EOS token
    ("stop", "Paris", ("stop_sequence", "Paris")),
    ("length", None, ("max_tokens", None)),
    ("tool_calls", None, ("tool_use", None)),
])
def test_stop_reasons_map_to_anthropics(finish, stop, expected):
    assert stop_reason(finish, stop) == expected


def test_errors_take_the_shape_of_the_path():
    e = bad_request("max_tokens must be positive", "max_tokens")
    assert json.loads(error_response(e, "/v1/messages").body) == {
        "type": "error", "error": {"type": "invalid_request_error",
                                   "message": "max_tokens must be positive"}}
    assert json.loads(error_response(model_not_found("x"), "/v1/messages/count_tokens").body
                      )["error"]["type"] == "not_found_error"
    assert json.loads(error_response(e, "/v1/responses").body)["error"]["param"] == \
        "max_tokens"
    assert json.loads(error_response(e, "/v1/messagesx").body)["error"]["param"] == \
        "max_tokens"
