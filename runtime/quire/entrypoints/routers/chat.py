"""/v1/chat/completions: the messages rendered by the chat template (in the tokenizer pool),
one engine request with n samples, answered whole or streamed."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from quire.entrypoints.errors import OpenAIError, bad_request, renamed
from quire.entrypoints.limits import check_stop
from quire.entrypoints.logprobs import chat_logprobs
from quire.entrypoints.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    ChatStreamChoice,
    UsageInfo,
)
from quire.entrypoints.routers.common import (
    client_gone_response,
    disconnected,
    json_response,
    read_body,
    serving_of,
)
from quire.entrypoints.serving import ClientDisconnected
from quire.entrypoints.streaming import GuardedStreamingResponse, StreamGuard, sse_events
from quire.outputs import CompletionOutput, RequestOutput
from quire.sampling_params import SamplingParams

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    serving = serving_of(request)
    req = await read_body(request, ChatCompletionRequest)
    info = serving.check_model(req.model)
    _check(req, serving.limits)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    renames = {"prompt": "messages", "logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    try:
        params = req.sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                     stream=req.stream, max_n=info.max_num_seqs)
    except OpenAIError as e:
        raise renamed(e, renames) from None
    prompt = await serving.chat_prompt_ids(req.messages, req.add_generation_prompt, info,
                                           req.chat_template)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await serving.submit(request_id, [prompt], params, renames)
    if req.stream:
        guard = StreamGuard(serving, streams)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatChunks(request_id, info.served_name, params)
        return GuardedStreamingResponse(
            sse_events(serving, request_id, guard, params.n, fmt, include_usage), guard,
            "text/event-stream")
    try:
        out = (await serving.finals(streams, disconnected(request)))[0]
    except ClientDisconnected:
        return client_gone_response()
    choices, completion_tokens = [], 0
    for c in sorted(out.outputs, key=lambda c: c.index):
        completion_tokens += len(c.token_ids)
        choices.append(ChatChoice(
            index=c.index, message=ChatMessageOut(content=c.text),
            logprobs=chat_logprobs(c, params.logprobs),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    serving.log_done(request_id, completion_tokens)
    return json_response(ChatCompletionResponse(
        id=request_id, model=info.served_name, choices=choices,
        usage=UsageInfo.of(len(out.prompt_token_ids), completion_tokens)))


class ChatChunks:
    """The ChunkFormat of chat streams: the role first, then content deltas."""

    def __init__(self, request_id: str, model: str, params: SamplingParams) -> None:
        self.head = {"id": request_id, "created": int(time.time()), "model": model}
        self.params = params

    def opening(self) -> list[ChatCompletionChunk]:
        return [ChatCompletionChunk(**self.head, choices=[ChatStreamChoice(
            index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(self.params.n)]

    def choice(self, index: int, prompt_index: int, out: RequestOutput,
               c: CompletionOutput) -> ChatCompletionChunk | None:
        lps = chat_logprobs(c, self.params.logprobs)
        if not c.text and lps is None and c.finish_reason is None:
            return None
        return ChatCompletionChunk(**self.head, choices=[ChatStreamChoice(
            index=index, delta=ChatDelta(content=c.text or None), logprobs=lps,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason)])

    def usage(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.head, choices=[], usage=usage)


def _check(req: ChatCompletionRequest, limits) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    if req.tools:
        raise bad_request("tools is not supported by this server", "tools")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise bad_request("response_format other than {'type': 'text'} is not supported",
                          "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    check_stop(req.stop, req.stop_token_ids, limits)
