"""/v1/chat/completions: the messages (and tools) rendered by the chat template in the
tokenizer pool (with chat_template_kwargs over the server's defaults), one engine request with
n samples, its grammar from response_format / guided_* / tool_choice, answered whole or
streamed, with the reasoning split off (--reasoning-parser) and tool calls read out of the
content."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from quire.entrypoints.chat_reasoning import (
    ReasoningDeltas,
    ReasoningUse,
    reasoning_use,
    split_answer,
)
from quire.entrypoints.chat_tools import ToolCallDeltas, ToolUse, message_parts, tool_use
from quire.entrypoints.continuation import continued_prompts
from quire.entrypoints.errors import bad_request
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
from quire.entrypoints.structured_output import guided_decoding
from quire.outputs import CompletionOutput, RequestOutput
from quire.sampling_params import SamplingParams

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    serving = serving_of(request)
    req = await read_body(request, ChatCompletionRequest)
    info, lora = serving.model_for(req.model)
    model = lora.name if lora else req.model or info.served_name  # the name asked for
    _check(req, serving.limits)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    renames = {"prompt": "messages", "logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    template = serving.chat_template(req.chat_template)
    tools = await tool_use(serving, req, template)
    guided = await guided_decoding(serving, req)
    if tools.guided is not None and guided is not None:
        raise bad_request("tool_choice 'required' or a named function constrains the answer "
                          "already; it can't be combined with response_format or guided_* "
                          "fields", "tool_choice")
    params = req.sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                 stream=req.stream, max_n=info.max_num_seqs,
                                 guided_decoding=tools.guided or guided, renames=renames)
    prompt = await serving.chat_prompt_ids(req.messages, req.add_generation_prompt, info,
                                           req.chat_template, tools=tools.tools,
                                           template_kwargs=req.chat_template_kwargs)
    prompt = continued_prompts([prompt], req)[0]
    reasoning = await reasoning_use(serving, req, prompt, params.guided_decoding is not None)
    if reasoning.parser is not None and reasoning.parser.needs_special_tokens:
        params.skip_special_tokens = False  # its markers (harmony's) are special tokens
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await serving.submit(request_id, [prompt], params, renames, lora,
                                   cache_salt=req.cache_salt, priority=req.priority)
    if req.stream:
        guard = StreamGuard(serving, streams)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatChunks(request_id, model, params, tools, reasoning)
        return GuardedStreamingResponse(
            sse_events(serving, request_id, guard, params.n, fmt, include_usage,
                       token_ids=req.return_token_ids), guard,
            "text/event-stream")
    try:
        out = (await serving.finals(streams, disconnected(request)))[0]
    except ClientDisconnected:
        return client_gone_response()
    choices, completion_tokens = [], 0
    for c in sorted(out.outputs, key=lambda c: c.index):
        completion_tokens += len(c.token_ids)
        thought, content = split_answer(reasoning, c.text)
        content, tool_calls, finish_reason = message_parts(tools, content, c.finish_reason)
        choices.append(ChatChoice(
            index=c.index, message=ChatMessageOut(content=content, reasoning_content=thought,
                                                  tool_calls=tool_calls),
            logprobs=chat_logprobs(c, params.logprobs),
            finish_reason=finish_reason, stop_reason=c.stop_reason))
    serving.log_done(request_id, completion_tokens, out.num_cached_tokens)
    return json_response(ChatCompletionResponse(
        id=request_id, model=model, choices=choices,
        usage=UsageInfo.of(len(out.prompt_token_ids), completion_tokens,
                           out.num_cached_tokens)))


class ChatChunks:
    """The ChunkFormat of chat streams: the role first, then content deltas (and, with a
    reasoning parser, delta.reasoning_content pieces; when the answer is read for tool calls,
    delta.tool_calls pieces from its content)."""

    def __init__(self, request_id: str, model: str, params: SamplingParams,
                 tools: ToolUse, reasoning: ReasoningUse | None = None) -> None:
        self.head = {"id": request_id, "created": int(time.time()), "model": model}
        self.params = params
        self.tool_calls = ToolCallDeltas(tools.parser) if tools.parser is not None else None
        self.reasoning = ReasoningDeltas(reasoning) if reasoning is not None and \
            reasoning.parser is not None else None

    def opening(self) -> list[ChatCompletionChunk]:
        return [ChatCompletionChunk(**self.head, choices=[ChatStreamChoice(
            index=i, delta=ChatDelta(role="assistant", content=""))])
            for i in range(self.params.n)]

    def choice(self, index: int, prompt_index: int, out: RequestOutput,
               c: CompletionOutput) -> ChatCompletionChunk | None:
        lps = chat_logprobs(c, self.params.logprobs)
        thought, text = None, c.text
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(index, c.text, c.finish_reason is not None)
        content, calls, finish_reason = text or None, None, c.finish_reason
        if self.tool_calls is not None:
            content, calls, finish_reason = self.tool_calls.feed(index, text, finish_reason)
        if not content and not thought and not calls and lps is None and finish_reason is None:
            return None
        return ChatCompletionChunk(**self.head, choices=[ChatStreamChoice(
            index=index, delta=ChatDelta(content=content, reasoning_content=thought,
                                         tool_calls=calls), logprobs=lps,
            finish_reason=finish_reason, stop_reason=c.stop_reason)])

    def usage(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(**self.head, choices=[], usage=usage)


def _check(req: ChatCompletionRequest, limits) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    check_stop(req.stop, req.stop_token_ids, limits)
