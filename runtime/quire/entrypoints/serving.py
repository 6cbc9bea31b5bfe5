"""What every endpoint shares: the engine, the tokenizer pool, the limits and the metrics,
and the steps of serving one request (check the model, tokenize within the limits, submit
the engine requests, wait for the answer unless the client goes away)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from quire.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineNotReady,
    EngineState,
    ModelInfo,
    RequestStream,
)
from quire.entrypoints import request_tracing
from quire.entrypoints.errors import bad_request, engine_error, model_not_found
from quire.entrypoints.limits import (
    ServerLimits,
    check_chat_template,
    check_chat_template_kwargs,
    check_messages,
    check_prompt_chars,
    check_prompt_tokens,
)
from quire.entrypoints.reasoning import ReasoningParser
from quire.entrypoints.responses_store import ResponseStore
from quire.entrypoints.tokenizer_pool import TokenizerPool
from quire.lora.request import LoRARequest
from quire.multimodal.inputs import ProcessedPrompt
from quire.outputs import RequestOutput
from quire.pooling.params import PoolingParams
from quire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


_GENERATE = SamplingParams()  # what check_runner reads a generation endpoint as


class ClientDisconnected(Exception):
    """The client went away before its answer was ready (not an error: nobody reads it)."""


@dataclass
class Serving:
    engine: AsyncLLMEngine
    limits: ServerLimits
    metrics: object | None = None          # ServerMetrics, or None
    log_requests: bool = False
    tool_call_parser: str = "auto"         # --tool-call-parser: a family, or auto-detected
    lora_parents: dict[str, str] = field(default_factory=dict)  # --lora-modules base_model_name
    model_aliases: tuple[str, ...] = ()    # the base model's other --served-model-name names
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    default_template_kwargs: dict = field(default_factory=dict)  # --default-chat-template-kwargs
    _pool: TokenizerPool | None = None
    _special_ids: frozenset[int] | None = None
    _responses: ResponseStore | None = None

    @property
    def responses(self) -> ResponseStore:
        """/v1/responses' stored responses, bounded by the limits."""
        if self._responses is None:
            self._responses = ResponseStore(self.limits.max_stored_responses,
                                            self.limits.stored_response_ttl)
        return self._responses

    @property
    def pool(self) -> TokenizerPool:
        """The tokenizer threads; made on first use (after check_model: the tokenizer exists
        once the model has loaded)."""
        if self._pool is None:
            self._pool = TokenizerPool(self.engine.tokenizer, self.limits.tokenizer_pool_size,
                                       self.limits.tokenizer_pool_queue)
        return self._pool

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    # --- the model -----------------------------------------------------------------------
    def check_model(self, name: str | None) -> ModelInfo:
        """The loaded model's info; 503 while loading or dead, 404 for a `model` that is
        neither the base model's served name nor a loaded LoRA adapter."""
        return self.model_for(name)[0]

    def model_for(self, name: str | None,
                  runner: str | None = None) -> tuple[ModelInfo, LoRARequest | None]:
        """check_model, and the adapter `name` picks (None: the base model). `runner`: what
        the endpoint needs ('generate' or 'pooling'); a server of the other runner says why
        with a 400 before any work."""
        state = self.engine.state
        if state is EngineState.DEAD:
            raise engine_error(EngineDeadError(self.engine.fatal_error))
        info = self.engine.model_info
        if state is EngineState.LOADING or info is None:  # None: stopped while loading
            raise engine_error(EngineNotReady("the model is still loading"))
        if runner is not None:
            self.check_runner(PoolingParams() if runner == "pooling" else _GENERATE)
        if name is None or name == info.served_name or name in self.model_aliases:
            request_tracing.note_model(name, info.served_name, None)
            return info, None
        lora = self.engine.lora_adapters.get(name)
        if lora is None:
            raise model_not_found(name)
        request_tracing.note_model(name, info.served_name, lora.name)
        return info, lora

    def textless_ids(self, params: SamplingParams) -> frozenset[int]:
        """Token ids that add nothing to a completion's text: the special tokens, when
        skip_special_tokens leaves them out."""
        if not params.skip_special_tokens:
            return frozenset()
        if self._special_ids is None:
            self._special_ids = frozenset(getattr(self.engine.tokenizer, "all_special_ids", ()))
        return self._special_ids

    # --- prompts, by size first: characters, then tokens ---------------------------------
    async def prompt_ids(self, prompt: str | list[int], info: ModelInfo,
                         param: str = "prompt", add_special_tokens: bool = True,
                         truncate: int | None = None) -> list[int]:
        """`truncate` (vLLM's truncate_prompt_tokens, checked): keep the prompt's last this
        many tokens, -1 as many as fit."""
        pooling = info.runner == "pooling"  # (no answer after the prompt: it may fill all)
        if truncate == -1:
            truncate = info.max_model_len - (0 if pooling else 1)
        if isinstance(prompt, str):
            check_prompt_chars(param, len(prompt), self.limits.prompt_chars(info.max_model_len))
            ids = await self.pool.encode(prompt, add_special_tokens)
            ids = ids[-truncate:] if truncate else ids
            check_prompt_tokens(param, len(ids), info.max_model_len, pooling)
            return ids
        prompt = prompt[-truncate:] if truncate else prompt
        check_prompt_tokens(param, len(prompt), info.max_model_len, pooling)
        if prompt and not 0 <= min(prompt) <= max(prompt) < info.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < info.vocab_size)
            raise bad_request(f"{param} token ids must be integers in [0, {info.vocab_size}), "
                              f"got {bad}", param)
        return prompt

    async def chat_prompt_ids(self, messages, add_generation_prompt: bool, info: ModelInfo,
                              chat_template: str | None = None,
                              check_length: bool = True,
                              tools: list[dict] | None = None,
                              template_kwargs: dict | None = None,
                              continue_final_message: bool = False) -> list[int]:
        """`template_kwargs`: the request's chat_template_kwargs (over the server's
        defaults); `continue_final_message`: the prompt ends inside the last message."""
        check_messages(messages, self.limits, info.max_model_len)
        check_chat_template(chat_template, self.limits)
        check_chat_template_kwargs(template_kwargs, self.limits, info.max_model_len)
        conversation = [m.as_template_message() for m in messages]
        ids = await self.pool.chat(conversation, add_generation_prompt, chat_template,
                                   self.limits.chat_template_timeout,
                                   self.limits.prompt_chars(info.max_model_len), tools,
                                   self.template_kwargs(template_kwargs),
                                   continue_final_message)
        if check_length:
            check_prompt_tokens("messages", len(ids), info.max_model_len)
        return ids

    def template_kwargs(self, request_kwargs: dict | None) -> dict:
        """The chat template's extra variables: the server's defaults, the request's over
        them."""
        return {**self.default_template_kwargs, **(request_kwargs or {})}

    async def prompt_tail(self, prompt: list[int], num_tokens: int = 8) -> str:
        """The text of a prompt's last few tokens, special tokens included (what a reasoning
        parser reads the answer's start state from)."""
        return await self.pool.decode(prompt[-num_tokens:])

    def chat_template(self, request_template: str | None) -> str | None:
        """The template a chat prompt is rendered with: the request's own, or the model's."""
        return request_template or getattr(self.engine.tokenizer, "chat_template", None)

    # --- engine requests -----------------------------------------------------------------
    async def submit(self, request_id: str, prompts: Sequence[list[int] | ProcessedPrompt],
                     params: SamplingParams,
                     renames: dict[str, str] | None = None,
                     lora_request: LoRARequest | None = None,
                     cache_salt: str | None = None,
                     priority: int | None = None) -> list[RequestStream]:
        """One engine request per prompt (token ids, or a prompt with images the processor
        made), all or none: if one is refused, the
        others are aborted. lora_request: the adapter model_for picked, or None. cache_salt:
        the request's (checked when the body was parsed). priority: the request's (lower
        first under --scheduling-policy priority). A request for the other runner
        (generation on a pooling server, embeddings on a generation one) gets a 400."""
        self.check_runner(params)
        ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}"
               for i in range(len(prompts))]
        results = await asyncio.gather(
            *(self.engine.add_request(rid, p, params, lora_request=lora_request,
                                      cache_salt=cache_salt, **_priority(priority))
              for rid, p in zip(ids, prompts)),
            return_exceptions=True)  # added in the same step; every outcome retrieved
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if errors:
            for s in streams:
                s.abort()
            if not isinstance(errors[0], Exception):  # cancelled
                raise errors[0]
            raise engine_error(errors[0], renames) from None
        prompts = [p.token_ids if isinstance(p, ProcessedPrompt) else p for p in prompts]
        if self.log_requests:
            for rid, prompt in zip(ids, prompts):
                logger.info("request %s: %d prompt tokens, %s, params=%s", rid, len(prompt),
                            "cache_salt set" if cache_salt is not None else "no cache_salt",
                            params)
        return request_tracing.follow(request_id, prompts, params, streams)

    def check_runner(self, params) -> None:
        """400 for a generation request to a pooling server, or an embedding request to a
        generation server (`params`: SamplingParams or PoolingParams)."""
        runner = self.engine.model_info.runner
        if isinstance(params, PoolingParams) and runner != "pooling":
            raise bad_request("this model generates text; embeddings, score and rerank need a "
                              "server started with --runner pooling (or --convert embed)",
                              "model")
        if isinstance(params, SamplingParams) and runner == "pooling":
            raise bad_request("this server runs the pooling runner (embeddings): it can't "
                              "generate text; use /v1/embeddings, /score or /rerank, or start "
                              "a server without --runner pooling", "model")

    async def finals(self, streams: list[RequestStream], disconnected) -> list[RequestOutput]:
        """The final output of each stream. If the client goes away first, every request is
        aborted and ClientDisconnected raised; engine failures become OpenAIErrors."""
        work = asyncio.ensure_future(_last_outputs(streams))
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                try:
                    return work.result()
                except Exception as e:  # noqa: BLE001 - RequestFailed, EngineDeadError
                    raise engine_error(e) from None
            self.client_gone()
            raise ClientDisconnected
        finally:
            for task in (work, watch):
                task.cancel()
            # retrieve whatever they ended with, so nothing is left "never retrieved"
            await asyncio.gather(work, watch, return_exceptions=True)
            for s in streams:
                s.abort()

    def client_gone(self) -> None:
        logger.debug("client disconnected; its requests are aborted")
        if self.metrics is not None:
            self.metrics.record_disconnect()

    def log_done(self, request_id: str, completion_tokens: int, cached_tokens: int) -> None:
        """`cached_tokens`: prompt tokens served from the prefix cache (usage's
        prompt_tokens_details.cached_tokens)."""
        if self.log_requests:
            logger.info("request %s finished: %d tokens, %d prompt tokens cached", request_id,
                        completion_tokens, cached_tokens)


async def _last_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    finals = []
    for stream in streams:  # they all run at once in the engine; reading order is free
        last = None
        async for out in stream:
            last = out
        finals.append(last)
    return finals


def _priority(priority: int) -> dict:
    """Only a set priority is passed on (an engine stand-in without it still works)."""
    return {"priority": priority} if priority else {}
