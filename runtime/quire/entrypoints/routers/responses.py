"""/v1/responses (OpenAI's Responses API, as vLLM serves it): the input items, after the
stored conversation `previous_response_id` names, answered as a chat completion (chat_run.py:
the same template, tools, reasoning parser, grammar, limits, cache_salt, LoRA and metrics),
whole or as the Responses event stream; GET /v1/responses/{id} returns a stored response and
DELETE forgets it.

The stream: response.created, response.in_progress, then per output item (reasoning, the
message, each function call) output_item.added, its content part's added / deltas / done
events, output_item.done, and last response.completed (response.incomplete when
max_output_tokens ran out; an engine failure sends `error` then response.failed). Every event
carries its sequence_number.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from quire.engine.async_engine import EngineDeadError, RequestFailed
from quire.entrypoints.chat_run import (
    ChatRun,
    StreamTally,
    answer_parts,
    start_chat,
    stream_pieces,
)
from quire.entrypoints.errors import OpenAIError, bad_request, engine_error
from quire.entrypoints.openai_protocol import ChatStreamChoice
from quire.entrypoints.responses_conversation import (
    answered,
    chat_request,
    conversation_of,
    new_id,
    output_items,
    responses_names,
)
from quire.entrypoints.responses_protocol import (
    FunctionCallOut,
    IncompleteDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItemOut,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from quire.entrypoints.responses_store import StoredResponse
from quire.entrypoints.routers.common import (
    disconnected,
    json_body,
    json_response,
    read_body,
    serving_of,
)
from quire.entrypoints.streaming import GuardedStreamingResponse, StreamGuard

router = APIRouter()


@router.post("/v1/responses", response_model=ResponseObject,
             openapi_extra=json_body(ResponsesRequest))
async def create_response(request: Request):
    serving = serving_of(request)
    req = await read_body(request, ResponsesRequest)
    _check(req)
    previous = None
    if req.previous_response_id is not None:
        previous = serving.responses.get(req.previous_response_id)
        if previous is None:
            raise response_not_found(req.previous_response_id, "previous_response_id")
    conversation = conversation_of(req, previous)
    response_id = new_id("resp")
    with responses_names():
        run = await start_chat(serving, chat_request(req, conversation), response_id,
                               priority=req.priority)
    head = _head(req, run, response_id)
    if req.stream:
        guard = StreamGuard(serving, run.streams)
        events = ResponseEvents(serving, run, req, head, conversation)
        return GuardedStreamingResponse(events.stream(guard), guard, "text/event-stream")
    out = (await serving.finals(run.streams, disconnected(request)))[0]
    c = out.outputs[0]
    parts = answer_parts(run, c)
    output = output_items(parts, req.top_logprobs is not None)
    response = await _finished(serving, head, output, parts.finish_reason,
                               len(out.prompt_token_ids), len(c.token_ids),
                               out.num_cached_tokens)
    serving.log_done(response_id, len(c.token_ids), out.num_cached_tokens)
    _store(serving, req, response, conversation)
    return json_response(response)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def retrieve_response(request: Request, response_id: str):
    stored = serving_of(request).responses.get(response_id)
    if stored is None:
        raise response_not_found(response_id, "response_id")
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str):
    if not serving_of(request).responses.delete(response_id):
        raise response_not_found(response_id, "response_id")
    return {"id": response_id, "object": "response", "deleted": True}


def response_not_found(response_id: str, param: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id[:100]}' not found (responses "
                            f"are kept when created with store: true, for a while: "
                            f"--max-stored-responses, --stored-response-ttl).",
                       "invalid_request_error", param, "response_not_found")


def _check(req: ResponsesRequest) -> None:
    if req.background:
        raise bad_request("background responses are not supported", "background")
    if req.conversation is not None:
        raise bad_request("conversation is not supported (OpenAI's Conversations API): carry "
                          "the context with previous_response_id or in input", "conversation")
    if req.prompt is not None:
        raise bad_request("prompt (a stored prompt template) is not supported: send the "
                          "instructions and input themselves", "prompt")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request(f"top_logprobs must be an integer in [0, 20], got "
                          f"{req.top_logprobs}", "top_logprobs")
    if req.max_tool_calls is not None and req.max_tool_calls < 1:
        raise bad_request("max_tool_calls must be a positive integer", "max_tool_calls")
    if not -(1 << 31) <= req.priority < 1 << 31:
        raise bad_request(f"priority must be an integer in [-2^31, 2^31), got "
                          f"{req.priority}", "priority")


def _head(req: ResponsesRequest, run: ChatRun, response_id: str) -> ResponseObject:
    """The response's echo of the request (status and output filled in later)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) \
        if req.text is not None and req.text.format is not None else {"type": "text"}
    choice = req.tool_choice if isinstance(req.tool_choice, str) else (
        req.tool_choice.model_dump() if req.tool_choice is not None else "auto")
    return ResponseObject(
        id=response_id, status="in_progress", model=run.model,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        reasoning=req.reasoning.model_dump() if req.reasoning is not None else None,
        store=req.store, temperature=run.params.temperature, top_p=run.params.top_p,
        top_logprobs=req.top_logprobs, text={"format": fmt}, tool_choice=choice,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        truncation=req.truncation or "disabled", user=req.user, metadata=req.metadata)


async def _finished(serving, head: ResponseObject, output: list[OutputItem],
                    finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int) -> ResponseObject:
    reasoning = "".join(p.text for item in output if isinstance(item, ReasoningItemOut)
                        for p in item.content)
    reasoning_tokens = len(await serving.pool.encode(reasoning, False)) if reasoning else 0
    incomplete = finish_reason == "length"
    return head.model_copy(update={
        "status": "incomplete" if incomplete else "completed", "output": output,
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete
        else None,
        "usage": ResponseUsage.of(prompt_tokens, completion_tokens, cached_tokens,
                                  min(reasoning_tokens, completion_tokens))})


def _store(serving, req: ResponsesRequest, response: ResponseObject,
           conversation: list[dict]) -> None:
    if req.store:
        serving.responses.put(response.id, StoredResponse(
            response.model_dump(mode="json"), answered(conversation, response.output)))


class ResponseEvents:
    """One streamed response: the chat deltas of the answer as Responses events."""

    def __init__(self, serving, run: ChatRun, req: ResponsesRequest, head: ResponseObject,
                 conversation: list[dict]) -> None:
        self.serving, self.run, self.req, self.head = serving, run, req, head
        self.conversation = conversation
        self.sequence = 0
        self.output: list[OutputItem] = []
        self.item: OutputItem | None = None  # the item being streamed
        self.text = ""                       # its text or arguments so far
        self.logprobs: list = []

    async def stream(self, guard: StreamGuard) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._dump(self.head))
        yield self._event("response.in_progress", response=self._dump(self.head))
        tally = StreamTally()
        try:
            async for piece in stream_pieces(self.run, tally):
                for event in self._piece(piece):
                    yield event
            for event in self._close():
                yield event
            if not self.output:  # nothing at all was said: one empty message
                for event in [*self._open(OutputMessage(id=new_id("msg"))), *self._close()]:
                    yield event
            response = await _finished(self.serving, self.head, self.output,
                                       tally.finish_reason, tally.prompt_tokens,
                                       tally.completion_tokens, tally.cached_tokens)
            self.serving.log_done(self.head.id, tally.completion_tokens, tally.cached_tokens)
            _store(self.serving, self.req, response, self.conversation)
            kind = "response.incomplete" if response.status == "incomplete" \
                else "response.completed"
            yield self._event(kind, response=self._dump(response))
        except (RequestFailed, EngineDeadError) as e:
            err = engine_error(e)
            yield self._event("error", code=str(err.code), message=err.message, param=None)
            failed = self.head.model_copy(update={
                "status": "failed", "output": self.output,
                "error": ResponseError(code="server_error", message=err.message)})
            yield self._event("response.failed", response=self._dump(failed))
        guard.completed = True

    # --- the items ----------------------------------------------------------------------
    def _piece(self, piece: ChatStreamChoice) -> list[str]:
        d, events = piece.delta, []
        if d.reasoning_content:
            if not isinstance(self.item, ReasoningItemOut):
                events += self._close() + self._open(ReasoningItemOut(id=new_id("rs")))
            events += self._delta(d.reasoning_content)
        if d.content:
            if not isinstance(self.item, OutputMessage):
                events += self._close() + self._open(OutputMessage(id=new_id("msg")))
            if piece.logprobs is not None and piece.logprobs.content:
                self.logprobs += piece.logprobs.content
            events += self._delta(d.content, piece)
        for call in d.tool_calls or ():
            if call.id is not None:  # a new call: its id and name come first
                events += self._close() + self._open(FunctionCallOut(
                    id=new_id("fc"), call_id=call.id, name=call.function.name,
                    arguments=""))
            if call.function is not None and call.function.arguments:
                events += self._delta(call.function.arguments)
        if piece.finish_reason == "length" and self.item is not None:
            self.item = self.item.model_copy(update={"status": "incomplete"})
        return events

    def _open(self, item: OutputItem) -> list[str]:
        self.item, self.text, self.logprobs = item, "", []
        shown = item.model_copy(update={"status": "in_progress"})
        if isinstance(shown, (OutputMessage, ReasoningItemOut)):
            shown = shown.model_copy(update={"content": []})
        events = [self._event("response.output_item.added", output_index=len(self.output),
                              item=self._dump(shown))]
        if isinstance(item, OutputMessage):
            events.append(self._part_event("response.content_part.added",
                                           OutputText(text="")))
        elif isinstance(item, ReasoningItemOut):
            events.append(self._part_event("response.content_part.added",
                                           ReasoningText(text="")))
        return events

    def _delta(self, text: str, piece: ChatStreamChoice | None = None) -> list[str]:
        self.text += text
        where = {"item_id": self.item.id, "output_index": len(self.output)}
        if isinstance(self.item, FunctionCallOut):
            return [self._event("response.function_call_arguments.delta", **where,
                                delta=text)]
        if isinstance(self.item, ReasoningItemOut):
            return [self._event("response.reasoning_text.delta", **where, content_index=0,
                                delta=text)]
        lps = piece.logprobs.content if piece is not None and piece.logprobs is not None \
            else None
        return [self._event("response.output_text.delta", **where, content_index=0,
                            delta=text, logprobs=_delta_logprobs(lps or []))]

    def _close(self) -> list[str]:
        item = self.item
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": len(self.output)}
        status = "incomplete" if item.status == "incomplete" else "completed"
        if isinstance(item, FunctionCallOut):
            item = item.model_copy(update={"arguments": self.text, "status": status})
            events = [self._event("response.function_call_arguments.done", **where,
                                  name=item.name, arguments=self.text)]
        elif isinstance(item, ReasoningItemOut):
            part = ReasoningText(text=self.text)
            item = item.model_copy(update={"content": [part], "status": status})
            events = [self._event("response.reasoning_text.done", **where, content_index=0,
                                  text=self.text),
                      self._part_event("response.content_part.done", part)]
        else:
            part = OutputText(text=self.text, logprobs=self.logprobs
                              if self.req.top_logprobs is not None else None)
            item = item.model_copy(update={"content": [part], "status": status})
            events = [self._event("response.output_text.done", **where, content_index=0,
                                  text=self.text,
                                  logprobs=_delta_logprobs(self.logprobs)),
                      self._part_event("response.content_part.done", part)]
        events.append(self._event("response.output_item.done", output_index=len(self.output),
                                  item=self._dump(item)))
        self.output.append(item)
        self.item = None
        return events

    # --- the wire -----------------------------------------------------------------------
    def _part_event(self, kind: str, part) -> str:
        return self._event(kind, item_id=self.item.id, output_index=len(self.output),
                           content_index=0, part=self._dump(part))

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    @staticmethod
    def _dump(model) -> dict:
        return model.model_dump(mode="json")


def _delta_logprobs(entries) -> list[dict]:
    return [{"token": e.token, "logprob": e.logprob,
             "top_logprobs": [{"token": t.token, "logprob": t.logprob}
                              for t in e.top_logprobs]} for e in entries]
