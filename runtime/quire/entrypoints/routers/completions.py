"""/v1/completions: one engine request per prompt (its grammar from response_format or
guided_*), answered whole or streamed.

Scoring, as lm-eval's local-completions asks for it: `echo` with `logprobs` returns the
prompt's tokens with their logprobs (the engine's prompt logprobs, from the prefill's own
logits; the first token's is null) before the output's, and `max_tokens: 0` with echo scores
the prompt alone (the engine samples one token, which is not returned). vLLM's
`prompt_logprobs` extra adds each choice's prompt_logprobs in vLLM's shape."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from quire.entrypoints.continuation import continued_prompts
from quire.entrypoints.errors import bad_request
from quire.entrypoints.limits import check_count, check_stop
from quire.entrypoints.logprobs import completion_logprobs, echo_logprobs, prompt_logprobs_out
from quire.entrypoints.openai_protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamChunk,
    UsageInfo,
)
from quire.entrypoints.routers.common import (
    disconnected,
    json_response,
    read_body,
    serving_of,
)
from quire.entrypoints.streaming import GuardedStreamingResponse, StreamGuard, sse_events
from quire.entrypoints.structured_output import guided_decoding
from quire.outputs import CompletionOutput, RequestOutput
from quire.sampling_params import SamplingParams

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    serving = serving_of(request)
    req = await read_body(request, CompletionRequest)
    info, lora = serving.model_for(req.model, runner="generate")
    model = lora.name if lora else req.model or info.served_name  # the name asked for
    _check(req, serving.limits, info.vocab_size)
    prompts = _prompts(req.prompt)
    echo_only = req.echo and req.max_tokens == 0  # score the prompt, generate nothing
    params = req.sampling_params(max_tokens=1 if echo_only else req.max_tokens,
                                 logprobs=req.logprobs, stream=req.stream,
                                 guided_decoding=await guided_decoding(serving, req),
                                 prompt_logprobs=_engine_prompt_logprobs(req))
    truncate = req.checked_truncation()
    prompt_ids = continued_prompts([await serving.prompt_ids(p, info, truncate=truncate)
                                    for p in prompts], req)
    # echo needs each prompt's text: the client's own, or its (kept) token ids decoded
    echoes = [(p if isinstance(p, str) and not truncate else await serving.pool.decode(ids))
              if req.echo else "" for p, ids in zip(prompts, prompt_ids)]
    # echo's logprobs name each prompt token; the first one's text is not in any entry
    scoring = Scoring(echo_only, req.echo and req.logprobs is not None,
                      req.prompt_logprobs is not None,
                      [await serving.pool.decode(ids[:1]) for ids in prompt_ids]
                      if req.echo and req.logprobs is not None else [],
                      serving.textless_ids(params))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await serving.submit(request_id, prompt_ids, params, lora_request=lora,
                                   cache_salt=req.cache_salt, priority=req.priority)
    if req.stream:
        guard = StreamGuard(serving, streams)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = CompletionChunks(request_id, model, params, echoes, scoring)
        return GuardedStreamingResponse(
            sse_events(serving, request_id, guard, params.n, fmt, include_usage,
                       token_ids=req.return_token_ids), guard,
            "text/event-stream")
    finals = await serving.finals(streams, disconnected(request))
    choices, prompt_tokens, completion_tokens = [], 0, 0
    cached_tokens = sum(out.num_cached_tokens for out in finals)
    for p, out in enumerate(finals):
        prompt_tokens += len(out.prompt_token_ids)
        for c in sorted(out.outputs, key=lambda c: c.index):
            completion_tokens += 0 if echo_only else len(c.token_ids)
            choices.append(CompletionChoice(
                index=p * params.n + c.index, text=echoes[p] + ("" if echo_only else c.text),
                logprobs=scoring.logprobs(p, out, c, params.logprobs, 0),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                prompt_logprobs=scoring.prompt_logprobs(out)))
    serving.log_done(request_id, completion_tokens, cached_tokens)
    return json_response(CompletionResponse(
        id=request_id, model=model, choices=choices,
        usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens)))


class Scoring:
    """How a choice reports logprobs: the output's alone, or (echo) the prompt's first; and
    whether it carries vLLM's prompt_logprobs."""

    def __init__(self, echo_only: bool, echo_logprobs: bool, prompt_logprobs: bool,
                 first_tokens: list[str], textless: frozenset[int] = frozenset()) -> None:
        self.echo_only, self.echo_logprobs = echo_only, echo_logprobs
        self.with_prompt_logprobs, self.first_tokens = prompt_logprobs, first_tokens
        self.textless = textless  # token ids that add nothing to the text (text_offset)

    def logprobs(self, prompt_index: int, out: RequestOutput, c: CompletionOutput,
                 k: int | None, offset: int, first: bool = True):
        """`first`: this is the choice's first output (a stream's carries the prompt's)."""
        if k is None:
            return None
        if not self.echo_logprobs:
            return completion_logprobs(c, k, offset, self.textless)
        if self.echo_only:
            c = None
        if not first:  # a stream's later chunks: the output's tokens only
            return None if c is None else completion_logprobs(c, k, offset, self.textless)
        return echo_logprobs(out.prompt_token_ids, out.prompt_logprobs or [],
                             self.first_tokens[prompt_index], c, k, self.textless)

    def prompt_logprobs(self, out: RequestOutput):
        return prompt_logprobs_out(out.prompt_logprobs) if self.with_prompt_logprobs else None


def _engine_prompt_logprobs(req: CompletionRequest) -> int | None:
    """What the engine computes: the prompt_logprobs asked for, else echo's logprobs."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return req.logprobs if req.echo else None


class CompletionChunks:
    """The ChunkFormat of /v1/completions streams: text deltas, echo (and its logprobs)
    first."""

    def __init__(self, request_id: str, model: str, params: SamplingParams,
                 echoes: list[str], scoring: Scoring) -> None:
        self.head = {"id": request_id, "created": int(time.time()), "model": model}
        self.params, self.echoes, self.scoring = params, echoes, scoring
        self.offsets: dict[int, int] = {}  # characters sent per choice (logprobs' offsets)
        self.generates = not scoring.echo_only

    def opening(self) -> list:
        return []

    def choice(self, index: int, prompt_index: int, out: RequestOutput,
               c: CompletionOutput) -> CompletionStreamChunk | None:
        text = "" if self.scoring.echo_only else c.text
        first = index not in self.offsets
        if first:  # the first output of this choice
            self.offsets[index] = 0
            text = self.echoes[prompt_index] + text
        lps = self.scoring.logprobs(prompt_index, out, c, self.params.logprobs,
                                    self.offsets[index], first)
        self.offsets[index] += len(text)
        if not text and lps is None and c.finish_reason is None:
            return None
        return CompletionStreamChunk(**self.head, choices=[CompletionStreamChoice(
            index=index, text=text, logprobs=lps, finish_reason=c.finish_reason,
            stop_reason=c.stop_reason)])

    def usage(self, usage: UsageInfo) -> CompletionStreamChunk:
        return CompletionStreamChunk(**self.head, choices=[], usage=usage)


def _check(req: CompletionRequest, limits, vocab_size: int) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be a positive integer (0 only with echo: the "
                          "prompt scored, nothing generated), got 0", "max_tokens")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available when stream is true",
                          "prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          "stream_options")
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (str, list)):
        check_count("prompt", req.prompt, limits.max_prompts_per_request,
                    "max-prompts-per-request")
    check_stop(req.stop, req.stop_token_ids, limits, vocab_size)


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
