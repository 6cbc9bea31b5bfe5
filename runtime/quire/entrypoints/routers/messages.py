"""/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, as vLLM serves it for
Claude Code and the `anthropic` SDK): the conversation answered as a chat completion
(chat_run.py: the same template, tools, reasoning parser, grammar, limits, cache_salt, LoRA
and metrics), whole or as Anthropic's event stream. Errors are in Anthropic's shape
(errors.py picks it by path).

The stream: message_start, ping, then per content block (thinking, text, each tool_use)
content_block_start, content_block_delta (text_delta, thinking_delta, input_json_delta),
content_block_stop, and last message_delta (stop_reason, usage) and message_stop; an engine
failure sends an `error` event instead of the end.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from quire.engine.async_engine import EngineDeadError, RequestFailed
from quire.entrypoints.anthropic_conversation import (
    chat_request,
    content_blocks,
    messages_names,
    new_message_id,
    stop_reason,
    tool_use_id,
)
from quire.entrypoints.anthropic_protocol import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessagesUsage,
    TextBlock,
    ThinkingBlock,
    TokenCount,
    ToolUseBlock,
)
from quire.entrypoints.chat_media import image_chat_prompt, image_parts
from quire.entrypoints.chat_run import (
    ChatRun,
    StreamTally,
    answer_parts,
    start_chat,
    stream_pieces,
)
from quire.entrypoints.chat_tools import tool_use
from quire.entrypoints.errors import anthropic_body, engine_error
from quire.entrypoints.openai_protocol import ChatStreamChoice
from quire.entrypoints.routers.common import (
    disconnected,
    json_body,
    json_response,
    read_body,
    serving_of,
)
from quire.entrypoints.streaming import GuardedStreamingResponse, StreamGuard

router = APIRouter()


@router.post("/v1/messages", response_model=MessageResponse,
             openapi_extra=json_body(MessagesRequest))
async def create_message(request: Request):
    serving = serving_of(request)
    req = await read_body(request, MessagesRequest)
    message_id = new_message_id()
    with messages_names():
        run = await start_chat(serving, chat_request(req, req.stream), message_id)
    if req.stream:
        guard = StreamGuard(serving, run.streams)
        return GuardedStreamingResponse(MessageEvents(serving, run).stream(guard), guard,
                                        "text/event-stream")
    out = (await serving.finals(run.streams, disconnected(request)))[0]
    c = out.outputs[0]
    parts = answer_parts(run, c)
    reason, sequence = stop_reason(parts.finish_reason, parts.stop_reason)
    serving.log_done(message_id, len(c.token_ids), out.num_cached_tokens)
    return json_response(MessageResponse(
        id=message_id, model=run.model, content=content_blocks(parts), stop_reason=reason,
        stop_sequence=sequence,
        usage=MessagesUsage.of(len(out.prompt_token_ids), len(c.token_ids),
                               out.num_cached_tokens)))


@router.post("/v1/messages/count_tokens", response_model=TokenCount,
             openapi_extra=json_body(CountTokensRequest))
async def count_tokens(request: Request):
    """The prompt's tokens as /v1/messages would render it (system, tools and all)."""
    serving = serving_of(request)
    req = await read_body(request, CountTokensRequest)
    with messages_names():
        chat = chat_request(req)
        info = serving.check_model(chat.model)
        template = serving.chat_template(None)
        tools = await tool_use(serving, chat, template)
        if image_parts(chat.messages):  # as /v1/messages renders them (or refuses them)
            prompt = (await image_chat_prompt(
                serving, chat.messages, chat.add_generation_prompt, info, None, tools.tools,
                chat.chat_template_kwargs, chat.continue_final_message)).token_ids
        else:
            prompt = await serving.chat_prompt_ids(
                chat.messages, chat.add_generation_prompt, info, tools=tools.tools,
                template_kwargs=chat.chat_template_kwargs,
                continue_final_message=chat.continue_final_message)
    return json_response(TokenCount(input_tokens=len(prompt)))


class MessageEvents:
    """One streamed message: the chat deltas of the answer as Anthropic's events."""

    def __init__(self, serving, run: ChatRun) -> None:
        self.serving, self.run = serving, run
        self.index = -1        # the open content block's index
        self.kind: str | None = None  # its type: thinking, text or tool_use

    async def stream(self, guard: StreamGuard) -> AsyncIterator[str]:
        # the prefix-cache hit is known only once the engine has the request: message_start
        # counts the whole prompt, message_delta splits it (input + cache_read)
        start = MessageResponse(id=self.run.request_id, model=self.run.model,
                                usage=MessagesUsage(input_tokens=len(self.run.prompt),
                                                    output_tokens=0))
        yield _event("message_start", message=start.model_dump(mode="json"))
        yield _event("ping")
        tally = StreamTally()
        try:
            async for piece in stream_pieces(self.run, tally):
                for event in self._piece(piece):
                    yield event
            for event in self._close():
                yield event
            reason, sequence = stop_reason(tally.finish_reason, tally.stop_reason)
            usage = MessagesUsage.of(tally.prompt_tokens, tally.completion_tokens,
                                     tally.cached_tokens)
            self.serving.log_done(self.run.request_id, tally.completion_tokens,
                                  tally.cached_tokens)
            yield _event("message_delta",
                         delta={"stop_reason": reason, "stop_sequence": sequence},
                         usage=usage.model_dump())
            yield _event("message_stop")
        except (RequestFailed, EngineDeadError) as e:
            yield _event("error", **{k: v for k, v in anthropic_body(engine_error(e)).items()
                                     if k != "type"})
        guard.completed = True

    def _piece(self, piece: ChatStreamChoice) -> list[str]:
        d, events = piece.delta, []
        if d.reasoning_content:
            if self.kind != "thinking":
                events += self._open(ThinkingBlock(thinking=""))
            events.append(self._delta({"type": "thinking_delta",
                                       "thinking": d.reasoning_content}))
        if d.content:
            if self.kind != "text":
                events += self._open(TextBlock(text=""))
            events.append(self._delta({"type": "text_delta", "text": d.content}))
        for call in d.tool_calls or ():
            if call.id is not None:  # a new call: its id and name come first
                events += self._open(ToolUseBlock(id=tool_use_id(call.id),
                                                  name=call.function.name, input={}))
            if call.function is not None and call.function.arguments:
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": call.function.arguments}))
        return events

    def _open(self, block) -> list[str]:
        events = self._close()
        self.index += 1
        self.kind = block.type
        return events + [_event("content_block_start", index=self.index,
                                content_block=block.model_dump(mode="json"))]

    def _delta(self, delta: dict) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", index=self.index)]


def _event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"
