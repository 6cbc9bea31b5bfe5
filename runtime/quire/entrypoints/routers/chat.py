"""/v1/chat/completions: the messages (and tools) rendered by the chat template in the
tokenizer pool (with chat_template_kwargs over the server's defaults), one engine request with
n samples, its grammar from response_format / guided_* / tool_choice, answered whole or
streamed, with the reasoning split off (--reasoning-parser) and tool calls read out of the
content. The steps every chat-shaped API shares are in chat_run.py."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from quire.entrypoints.chat_run import ChatChunks, answer_parts, echoed, start_chat
from quire.entrypoints.logprobs import prompt_logprobs_out
from quire.entrypoints.openai_protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    UsageInfo,
)
from quire.entrypoints.routers.common import (
    disconnected,
    json_response,
    read_body,
    serving_of,
)
from quire.entrypoints.streaming import GuardedStreamingResponse, StreamGuard, sse_events

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    serving = serving_of(request)
    req = await read_body(request, ChatCompletionRequest)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    run = await start_chat(serving, req, request_id, priority=req.priority)
    echo = echoed(req)
    if req.stream:
        guard = StreamGuard(serving, run.streams)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatChunks(request_id, run.model, run.params, run.tools, run.reasoning, echo)
        return GuardedStreamingResponse(
            sse_events(serving, request_id, guard, run.params.n, fmt, include_usage,
                       token_ids=req.return_token_ids), guard,
            "text/event-stream")
    out = (await serving.finals(run.streams, disconnected(request)))[0]
    choices, completion_tokens = [], 0
    for c in sorted(out.outputs, key=lambda c: c.index):
        completion_tokens += len(c.token_ids)
        parts = answer_parts(run, c)
        content = echo + parts.content if echo and parts.content else echo or parts.content
        choices.append(ChatChoice(
            index=c.index, message=ChatMessageOut(content=content,
                                                  reasoning_content=parts.reasoning,
                                                  tool_calls=parts.tool_calls),
            logprobs=parts.logprobs, finish_reason=parts.finish_reason,
            stop_reason=parts.stop_reason))
    serving.log_done(request_id, completion_tokens, out.num_cached_tokens)
    return json_response(ChatCompletionResponse(
        id=request_id, model=run.model, choices=choices,
        usage=UsageInfo.of(len(out.prompt_token_ids), completion_tokens,
                           out.num_cached_tokens),
        prompt_logprobs=prompt_logprobs_out(out.prompt_logprobs)))
