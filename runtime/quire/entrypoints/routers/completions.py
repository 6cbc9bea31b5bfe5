"""/v1/completions: one engine request per prompt (its grammar from response_format or
guided_*), answered whole or streamed."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from quire.entrypoints.continuation import continued_prompts
from quire.entrypoints.errors import bad_request
from quire.entrypoints.limits import check_count, check_stop
from quire.entrypoints.logprobs import completion_logprobs
from quire.entrypoints.openai_protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamChunk,
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


@router.post("/v1/completions")
async def completions(request: Request):
    serving = serving_of(request)
    req = await read_body(request, CompletionRequest)
    info, lora = serving.model_for(req.model)
    model = lora.name if lora else req.model or info.served_name  # the name asked for
    _check(req, serving.limits)
    prompts = _prompts(req.prompt)
    params = req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs,
                                 stream=req.stream, max_n=info.max_num_seqs,
                                 guided_decoding=await guided_decoding(serving, req))
    prompt_ids = continued_prompts([await serving.prompt_ids(p, info) for p in prompts], req)
    # echo needs each prompt's text: the client's own, or its token ids decoded
    echoes = [(p if isinstance(p, str) else await serving.pool.decode(ids)) if req.echo
              else "" for p, ids in zip(prompts, prompt_ids)]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await serving.submit(request_id, prompt_ids, params, lora_request=lora,
                                   cache_salt=req.cache_salt, priority=req.priority)
    if req.stream:
        guard = StreamGuard(serving, streams)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = CompletionChunks(request_id, model, params, echoes)
        return GuardedStreamingResponse(
            sse_events(serving, request_id, guard, params.n, fmt, include_usage,
                       token_ids=req.return_token_ids), guard,
            "text/event-stream")
    try:
        finals = await serving.finals(streams, disconnected(request))
    except ClientDisconnected:
        return client_gone_response()
    choices, prompt_tokens, completion_tokens = [], 0, 0
    cached_tokens = sum(out.num_cached_tokens for out in finals)
    for p, out in enumerate(finals):
        prompt_tokens += len(out.prompt_token_ids)
        for c in sorted(out.outputs, key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            choices.append(CompletionChoice(
                index=p * params.n + c.index, text=echoes[p] + c.text,
                logprobs=completion_logprobs(c, params.logprobs, 0),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    serving.log_done(request_id, completion_tokens, cached_tokens)
    return json_response(CompletionResponse(
        id=request_id, model=model, choices=choices,
        usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens)))


class CompletionChunks:
    """The ChunkFormat of /v1/completions streams: text deltas, echo first."""

    def __init__(self, request_id: str, model: str, params: SamplingParams,
                 echoes: list[str]) -> None:
        self.head = {"id": request_id, "created": int(time.time()), "model": model}
        self.params, self.echoes = params, echoes
        self.offsets: dict[int, int] = {}  # characters sent per choice (logprobs' offsets)

    def opening(self) -> list:
        return []

    def choice(self, index: int, prompt_index: int, out: RequestOutput,
               c: CompletionOutput) -> CompletionStreamChunk | None:
        text = c.text
        if index not in self.offsets:  # the first output of this choice
            self.offsets[index] = 0
            text = self.echoes[prompt_index] + text
        lps = completion_logprobs(c, self.params.logprobs, self.offsets[index])
        self.offsets[index] += len(text)
        if not text and lps is None and c.finish_reason is None:
            return None
        return CompletionStreamChunk(**self.head, choices=[CompletionStreamChoice(
            index=index, text=text, logprobs=lps, finish_reason=c.finish_reason,
            stop_reason=c.stop_reason)])

    def usage(self, usage: UsageInfo) -> CompletionStreamChunk:
        return CompletionStreamChunk(**self.head, choices=[], usage=usage)


def _check(req: CompletionRequest, limits) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported: the engine does not compute "
                          "prompt logprobs", "echo")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (str, list)):
        check_count("prompt", req.prompt, limits.max_prompts_per_request,
                    "max-prompts-per-request")
    check_stop(req.stop, req.stop_token_ids, limits)


def _prompts(prompt) -> list:
    """The prompts of a completions request: one string or token-id list per prompt."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    elif isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    for p in prompts:
        if not p:
            raise bad_request("prompt must be a non-empty string or a non-empty list of "
                              "token ids", "prompt")
    return prompts
