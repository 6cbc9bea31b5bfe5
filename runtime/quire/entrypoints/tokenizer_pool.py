"""Tokenizing, detokenizing and chat-template rendering, in a few worker threads.

The event loop only does I/O: a megabyte prompt or a slow template must not hold up /health
or the streams of other clients, and the engine thread never tokenizes (the engine gets token
ids). The Rust tokenizer releases the GIL while it works; template rendering is Python and
yields the GIL every switch interval. Each thread has its own copy of the tokenizer (the fast
tokenizer's settings are not safe to share across threads).

Queueing is bounded: past `size + queue` jobs in flight, new requests get 503 at once rather
than waiting behind a backlog nobody can see.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading

from quire.entrypoints import request_chat_template
from quire.entrypoints.chat_continuation import template_rejected
from quire.entrypoints.errors import bad_request, server_busy
from quire.entrypoints.tool_calls.render import template_inputs


class TokenizerPool:
    def __init__(self, tokenizer, size: int, queue: int) -> None:
        self._tokenizer = tokenizer
        self._executor = concurrent.futures.ThreadPoolExecutor(size, "quire-tokenizer")
        self._max_in_flight = size + queue
        self._in_flight = 0
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn, *args):
        """fn(tokenizer, *args) in a worker thread; 503 when the pool's queue is full."""
        with self._lock:
            if self._in_flight >= self._max_in_flight:
                raise server_busy(f"the server is busy tokenizing ({self._in_flight} jobs); "
                                  "retry later")
            self._in_flight += 1
        # the count drops when the job ends in its thread, not when a cancelled caller leaves
        try:
            future = self._executor.submit(self._job, fn, args)
        except RuntimeError:  # shut down
            with self._lock:
                self._in_flight -= 1
            raise server_busy("the server is shutting down") from None
        return await asyncio.wrap_future(future)

    def _job(self, fn, args):
        try:
            tokenizer = getattr(self._local, "tokenizer", None)
            if tokenizer is None:
                tokenizer = self._local.tokenizer = copy.deepcopy(self._tokenizer)
            return fn(tokenizer, *args)
        finally:
            with self._lock:
                self._in_flight -= 1

    # --- the jobs ------------------------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(_encode, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self.run(_decode, token_ids)

    async def chat(self, conversation: list[dict], add_generation_prompt: bool,
                   request_template: str | None = None, timeout: float = 1.0,
                   max_chars: int = 1 << 20, tools: list[dict] | None = None,
                   template_kwargs: dict | None = None,
                   continue_final_message: bool = False) -> list[int]:
        """The prompt's token ids: the model's own template (trusted), or a request's own
        (sandboxed, within `timeout` seconds and `max_chars` characters). Tools, assistant
        tool calls and tool results go through the template as tool_calls/render.py says;
        `template_kwargs` are more template variables (chat_template_kwargs);
        `continue_final_message`: the prompt ends inside the last message."""
        return await self.run(_chat, conversation, add_generation_prompt, request_template,
                              timeout, max_chars, tools, template_kwargs,
                              continue_final_message)


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def _decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids)


def _chat(tokenizer, conversation, add_generation_prompt, request_template, timeout,
          max_chars, tools=None, template_kwargs=None,
          continue_final_message=False) -> list[int]:
    template = request_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions",
                          "messages")
    extra = {}
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in conversation):
        try:
            conversation, extra = template_inputs(template, conversation, tools)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
    extra = {**(template_kwargs or {}), **extra}  # the server's own variables win
    if request_template is not None:
        special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        text = request_chat_template.render(request_template, conversation,
                                            add_generation_prompt, special, timeout, max_chars,
                                            extra, continue_final_message)
        return _encode(tokenizer, text, add_special_tokens=False)
    try:
        ids = tokenizer.apply_chat_template(conversation,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            tokenize=True, return_dict=False, **extra)
    except Exception as e:  # noqa: BLE001 - templates raise on conversations they reject
        raise template_rejected(e) from None
    return list(ids)
