"""What the endpoints do: turn a parsed request into engine requests, then the engine's
outputs into OpenAI-shaped responses, whole or streamed as server-sent events.

Non-streaming requests ask the engine for FINAL_ONLY outputs; streams for DELTA outputs (each
holds only the new text, tokens and logprobs). Every engine request is aborted when its HTTP
request ends early, however it ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from typing import AsyncIterator, Sequence

from quire.engine.async_engine import (AsyncLLMEngine, EngineDeadError, EngineNotReady,
                                       EngineOverloaded, EngineShuttingDown, RequestFailed,
                                       RequestStream)
from quire.entrypoints.openai_protocol import (
    SSE_DONE, ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatMessageOut, CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
    GenerateRequest, OpenAIError, TokenLogprob, TopLogprob, UsageInfo, bad_request, param_of,
    sse)
from quire.outputs import CompletionOutput, Logprob, RequestOutput
from quire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ENGINE_PARAMS = {"prompt", "max_tokens", "request_id"}
RETRY_AFTER_SECONDS = "1"


def engine_error(e: Exception, renames: dict[str, str] | None = None) -> OpenAIError:
    """The HTTP answer to an exception from AsyncLLMEngine.add_request or a stream."""
    if isinstance(e, ValueError):
        return renamed(bad_request(str(e), param_of(str(e), ENGINE_PARAMS)), renames)
    if isinstance(e, EngineOverloaded):
        return OpenAIError(503, str(e), "server_error", None, "queue_full",
                           {"Retry-After": RETRY_AFTER_SECONDS})
    if isinstance(e, EngineNotReady):
        return OpenAIError(503, str(e), "server_error", None, "model_loading",
                           {"Retry-After": "5"})
    if isinstance(e, EngineShuttingDown):
        return OpenAIError(503, str(e), "server_error", None, "shutting_down")
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, f"the engine has failed: {e}", "server_error", None,
                           "engine_dead")
    if isinstance(e, RequestFailed):
        return OpenAIError(500, f"the request failed in the engine: {e}", "server_error",
                           None, "request_failed")
    raise e


def renamed(e: OpenAIError, renames: dict[str, str] | None) -> OpenAIError:
    """Name the parameter as this endpoint's request calls it (chat: prompt -> messages)."""
    if renames and e.param in renames:
        e.param = renames[e.param]
        e.message = f"{e.param}: {e.message}"
    return e


class Serving:
    def __init__(self, engine: AsyncLLMEngine, log_requests: bool = False) -> None:
        self.engine = engine
        self.log_requests = log_requests

    # --- shared --------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    def check_model(self, name: str | None) -> None:
        if self.engine.fatal_error is not None:
            raise engine_error(EngineDeadError(self.engine.fatal_error))
        if self.engine.engine is None or not self.engine.loaded.is_set():
            raise engine_error(EngineNotReady("the model is still loading"))
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"the model '{name}' does not exist; this server serves "
                                   f"'{self.model_name}' (see GET /v1/models)",
                              "invalid_request_error", "model", "model_not_found")

    @property
    def max_n(self) -> int:
        return self.engine.engine.args.max_num_seqs

    async def submit(self, request_id: str, prompts: Sequence, params: SamplingParams,
                     renames: dict[str, str] | None = None) -> list[RequestStream]:
        """Add one engine request per prompt, all in the same step; all or none (if one is
        refused, the others are aborted)."""
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}"
               for i in range(len(prompts))]
        results = await asyncio.gather(
            *(self.engine.add_request(rid, p, params) for rid, p in zip(ids, prompts)),
            return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if errors:
            for s in streams:
                s.abort()
            if not isinstance(errors[0], Exception):  # cancelled
                raise errors[0]
            raise engine_error(errors[0], renames) from None
        if self.log_requests:
            for rid, prompt in zip(ids, prompts):
                logger.info("request %s: prompt=%s params=%s", rid, _short(prompt), params)
        return streams

    def detokenize(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)

    def chat_prompt(self, messages, add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
        if not messages:
            raise bad_request("messages must be a non-empty list of messages", "messages")
        tokenizer = self.engine.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; pass "
                              "'chat_template' or use /v1/completions", "messages")
        conversation = [m.as_template_message() for m in messages]
        try:
            ids = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                chat_template=chat_template, return_dict=False)
        except Exception as e:  # noqa: BLE001 - templates raise on conversations they reject
            raise bad_request(f"the chat template rejected these messages: {e}",
                              "messages") from None
        return list(ids)

    # --- /v1/completions -----------------------------------------------------------------
    async def completions(self, req: CompletionRequest, disconnected) -> object:
        self.check_model(req.model)
        _reject_unsupported(req.logit_bias, "logit_bias")
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (only best_of == n)", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs is not supported: the engine does not "
                              "compute prompt logprobs", "echo")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        prompts = _prompts(req.prompt)
        params = req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs,
                                     stream=req.stream, max_n=self.max_n)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request_id, prompts, params)
        prompt_texts = [p if isinstance(p, str) else None for p in prompts]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._completion_stream(request_id, streams, params, req.echo,
                                           prompt_texts, include_usage)
        finals = await _collect(streams, disconnected)
        if finals is None:
            return None
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for p, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            for c in sorted(out.outputs, key=lambda c: c.index):
                completion_tokens += len(c.token_ids)
                text = c.text
                if req.echo:
                    text = self._prompt_text(prompt_texts[p], out) + text
                choices.append(CompletionChoice(
                    index=p * params.n + c.index, text=text,
                    logprobs=_completion_logprobs(c, params.logprobs, 0),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        self._log_done(request_id, completion_tokens)
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=UsageInfo.of(prompt_tokens, completion_tokens))

    def _prompt_text(self, text: str | None, out: RequestOutput) -> str:
        if text is not None:
            return text
        return out.prompt if out.prompt is not None else self.detokenize(out.prompt_token_ids)

    async def _completion_stream(self, request_id: str, streams: list[RequestStream],
                                 params: SamplingParams, echo: bool,
                                 prompt_texts: list[str | None],
                                 include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        n = params.n
        done: set[int] = set()
        echoed: set[int] = set()
        offsets = [0] * (len(streams) * n)
        prompt_tokens = [0] * len(streams)
        completion_tokens = 0
        try:
            async for p, out in _merge(streams):
                prompt_tokens[p] = len(out.prompt_token_ids)
                for c in out.outputs:
                    i = p * n + c.index
                    if i in done:
                        continue
                    text = c.text
                    if echo and i not in echoed:
                        echoed.add(i)
                        text = self._prompt_text(prompt_texts[p], out) + text
                    completion_tokens += len(c.token_ids)
                    lps = _completion_logprobs(c, params.logprobs, offsets[i])
                    offsets[i] += len(text)
                    if c.finish_reason is not None:
                        done.add(i)
                    if not text and lps is None and c.finish_reason is None:
                        continue
                    yield sse({"id": request_id, "object": "text_completion",
                               "created": created, "model": self.model_name,
                               "choices": [{"index": i, "text": text,
                                            "logprobs": lps.model_dump() if lps else None,
                                            "finish_reason": c.finish_reason,
                                            "stop_reason": c.stop_reason}]})
            if include_usage:
                usage = UsageInfo.of(sum(prompt_tokens), completion_tokens)
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.model_name, "choices": [],
                           "usage": usage.model_dump()})
            self._log_done(request_id, completion_tokens)
        except (RequestFailed, EngineDeadError) as e:
            yield sse(engine_error(e).body())
        finally:
            for s in streams:
                s.abort()
        yield SSE_DONE

    # --- /v1/chat/completions ------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, disconnected) -> object:
        self.check_model(req.model)
        _reject_unsupported(req.logit_bias, "logit_bias")
        _reject_unsupported(req.tools, "tools")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise bad_request("response_format other than {'type': 'text'} is not supported",
                              "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        renames = {"prompt": "messages", "logprobs": "top_logprobs"}
        if req.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        try:
            params = req.sampling_params(max_tokens=max_tokens, logprobs=logprobs,
                                         stream=req.stream, max_n=self.max_n)
        except OpenAIError as e:
            raise renamed(e, renames) from None
        prompt = self.chat_prompt(req.messages, req.add_generation_prompt, req.chat_template)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.submit(request_id, [prompt], params, renames)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._chat_stream(request_id, streams[0], params, include_usage)
        finals = await _collect(streams, disconnected)
        if finals is None:
            return None
        out = finals[0]
        choices, completion_tokens = [], 0
        for c in sorted(out.outputs, key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            choices.append(ChatChoice(
                index=c.index, message=ChatMessageOut(content=c.text),
                logprobs=_chat_logprobs(c, params.logprobs),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        self._log_done(request_id, completion_tokens)
        return ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices,
            usage=UsageInfo.of(len(out.prompt_token_ids), completion_tokens))

    async def _chat_stream(self, request_id: str, stream: RequestStream,
                           params: SamplingParams, include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        done: set[int] = set()
        prompt_tokens = completion_tokens = 0
        try:
            for i in range(params.n):  # the first delta of each choice carries the role
                yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                      "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
            async for out in stream:
                prompt_tokens = len(out.prompt_token_ids)
                for c in out.outputs:
                    if c.index in done:
                        continue
                    completion_tokens += len(c.token_ids)
                    lps = _chat_logprobs(c, params.logprobs)
                    if c.finish_reason is not None:
                        done.add(c.index)
                    if not c.text and lps is None and c.finish_reason is None:
                        continue
                    delta = {"content": c.text} if c.text else {}
                    yield sse({**head, "choices": [{
                        "index": c.index, "delta": delta,
                        "logprobs": lps.model_dump() if lps else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
            if include_usage:
                yield sse({**head, "choices": [],
                           "usage": UsageInfo.of(prompt_tokens, completion_tokens).model_dump()})
            self._log_done(request_id, completion_tokens)
        except (RequestFailed, EngineDeadError) as e:
            yield sse(engine_error(e).body())
        finally:
            stream.abort()
        yield SSE_DONE

    # --- /generate -----------------------------------------------------------------------
    async def generate(self, req: GenerateRequest, disconnected) -> object:
        self.check_model(req.model)
        params = req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs,
                                     stream=req.stream, max_n=self.max_n)
        request_id = f"gen-{uuid.uuid4().hex}"
        stream = (await self.submit(request_id, [req.prompt], params))[0]
        prompt_text = req.prompt if isinstance(req.prompt, str) else None
        if req.stream:
            return self._generate_stream(request_id, stream, params, prompt_text)
        finals = await _collect([stream], disconnected)
        if finals is None:
            return None
        out = finals[0]
        prefix = self._prompt_text(prompt_text, out)
        outputs = sorted(out.outputs, key=lambda c: c.index)
        self._log_done(request_id, sum(len(c.token_ids) for c in outputs))
        return {"text": [prefix + c.text for c in outputs]}

    async def _generate_stream(self, request_id: str, stream: RequestStream,
                               params: SamplingParams,
                               prompt_text: str | None) -> AsyncIterator[bytes]:
        texts: list[str] | None = None
        tokens = 0
        try:
            async for out in stream:
                if texts is None:
                    texts = [self._prompt_text(prompt_text, out)] * params.n
                changed = False
                for c in out.outputs:
                    tokens += len(c.token_ids)
                    if c.text:
                        texts[c.index] += c.text
                        changed = True
                if changed or out.finished:
                    yield (json.dumps({"text": texts}, ensure_ascii=False) + "\0").encode()
            self._log_done(request_id, tokens)
        except (RequestFailed, EngineDeadError) as e:
            yield (json.dumps(engine_error(e).body()) + "\0").encode()
        finally:
            stream.abort()

    def _log_done(self, request_id: str, completion_tokens: int) -> None:
        if self.log_requests:
            logger.info("request %s finished: %d tokens", request_id, completion_tokens)


# --- helpers --------------------------------------------------------------------------------
def _prompts(prompt) -> list:
    """The prompts of a completions request: one string or token-id list per prompt."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _reject_unsupported(value, name: str) -> None:
    if value:
        raise bad_request(f"{name} is not supported by this server", name)


async def _collect(streams: list[RequestStream], disconnected) -> list[RequestOutput] | None:
    """The final output of each stream, or None if the client went away first (every request
    is then aborted)."""
    async def final(stream: RequestStream) -> RequestOutput:
        last = None
        async for out in stream:
            last = out
        return last

    work = asyncio.ensure_future(asyncio.gather(*(final(s) for s in streams)))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            try:
                return work.result()
            except RequestFailed as e:
                raise engine_error(e) from None
            except EngineDeadError as e:  # it died while this request was in flight
                raise OpenAIError(500, f"the engine failed: {e}", "server_error", None,
                                  "engine_dead") from None
        return None
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        for s in streams:
            s.abort()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(end)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


def _clamp(lp: float) -> float:
    return max(lp, -9999.0) if not math.isnan(lp) else -9999.0


def _token_str(token_id: int, entry: dict[int, Logprob]) -> str:
    lp = entry.get(token_id)
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else ""


def _completion_logprobs(c: CompletionOutput, k: int | None,
                         offset: int) -> CompletionLogprobs | None:
    if k is None or c.logprobs is None:
        return None
    result = CompletionLogprobs()
    for tid, entry in zip(c.token_ids, c.logprobs):
        tok = _token_str(tid, entry)
        chosen = entry.get(tid)
        result.tokens.append(tok)
        result.token_logprobs.append(_clamp(chosen.logprob) if chosen else None)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
        top = {}
        for t, lp in ranked:
            if lp.rank <= k or t == tid:
                top.setdefault(lp.decoded_token or "", _clamp(lp.logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(tok)
    return result


def _chat_logprobs(c: CompletionOutput, k: int | None) -> ChatLogprobs | None:
    if k is None or c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs):
        tok = _token_str(tid, entry)
        chosen = entry.get(tid)
        top = [TopLogprob(token=lp.decoded_token or "", logprob=_clamp(lp.logprob),
                          bytes=list((lp.decoded_token or "").encode()))
               for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank) if lp.rank <= k]
        content.append(TokenLogprob(token=tok,
                                    logprob=_clamp(chosen.logprob) if chosen else -9999.0,
                                    bytes=list(tok.encode()), top_logprobs=top[:k]))
    return ChatLogprobs(content=content)


def _short(prompt, limit: int = 200) -> str:
    text = repr(prompt)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"

