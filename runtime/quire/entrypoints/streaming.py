"""The one streaming skeleton: engine requests -> chunks -> an HTTP response that cleans up
however it ends.

Completions and chat differ only in their chunks (a `ChunkFormat`); the skeleton merges the
engine streams of a request, skips choices that already finished, counts tokens for the usage
chunk, turns an engine failure into an error event, ends with [DONE], and aborts the engine
requests when the response ends early. /generate has its own body but the same guard and
response class.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Protocol

from pydantic import BaseModel
from starlette.responses import StreamingResponse

from quire.engine.async_engine import EngineDeadError, RequestFailed, RequestStream
from quire.entrypoints.errors import engine_error
from quire.entrypoints.openai_protocol import SSE_DONE, ErrorChunk, UsageInfo, sse
from quire.outputs import CompletionOutput, RequestOutput


class ChunkFormat(Protocol):
    # False where the outputs' tokens are the engine's own, not the client's (echo-only
    # scoring samples one token it never shows): then usage counts none and no ids are sent
    generates: bool

    def opening(self) -> list[BaseModel]:
        """Chunks sent before any token (chat: the role of each choice)."""

    def choice(self, index: int, prompt_index: int, out: RequestOutput,
               c: CompletionOutput) -> BaseModel | None:
        """The chunk for choice `index`'s new output, or None when it carries nothing."""

    def usage(self, usage: UsageInfo) -> BaseModel:
        """The last chunk, with no choices, when the client asked for usage."""


class StreamGuard:
    """The engine requests behind one response. `close()` (always called, once the response
    ends) aborts those still running, and counts the client as gone unless the body got to
    its end."""

    def __init__(self, serving, streams: list[RequestStream]) -> None:
        self.serving, self.streams = serving, streams
        self.completed = False
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self.streams:
            s.abort()
        if not self.completed:
            self.serving.client_gone()


class GuardedStreamingResponse(StreamingResponse):
    """A client that disconnects cancels the sending task, which may leave the body generator
    suspended (or never started): close it and the guard however the response ends."""

    def __init__(self, content, guard: StreamGuard, media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self.guard = guard

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            self.guard.close()


async def sse_events(serving, request_id: str, guard: StreamGuard, n: int, fmt: ChunkFormat,
                     include_usage: bool, token_ids: bool = False) -> AsyncIterator[str]:
    """`token_ids` (return_token_ids): each choice chunk also carries the ids of the tokens
    since the choice's last chunk, the first one the prompt's ids too."""
    done: set[int] = set()
    pending: dict[int, list[int]] = {}  # ids of tokens whose text no chunk has carried yet
    prompted: set[int] = set()          # choices whose chunks carried the prompt's ids
    prompt_tokens = [0] * len(guard.streams)
    cached_tokens = [0] * len(guard.streams)
    completion_tokens = 0
    try:
        for chunk in fmt.opening():
            yield sse(chunk)
        async for p, out in merge(guard.streams):
            prompt_tokens[p] = len(out.prompt_token_ids)
            cached_tokens[p] = out.num_cached_tokens
            for c in out.outputs:
                i = p * n + c.index
                if i in done:
                    continue
                shown = c.token_ids if fmt.generates else []
                completion_tokens += len(shown)
                if c.finish_reason is not None:
                    done.add(i)
                chunk = fmt.choice(i, p, out, c)
                if not token_ids:
                    if chunk is not None:
                        yield sse(chunk)
                    continue
                ids = pending.setdefault(i, [])
                ids.extend(shown)
                if chunk is not None:
                    first = i not in prompted
                    prompted.add(i)
                    yield _with_token_ids(chunk, ids, out.prompt_token_ids if first else None)
                    pending[i] = []
        if include_usage:
            yield sse(fmt.usage(UsageInfo.of(sum(prompt_tokens), completion_tokens,
                                             sum(cached_tokens))))
        serving.log_done(request_id, completion_tokens, sum(cached_tokens))
    except (RequestFailed, EngineDeadError) as e:
        yield sse(ErrorChunk.of(engine_error(e)))
    guard.completed = True
    yield SSE_DONE


def _with_token_ids(chunk: BaseModel, ids: list[int], prompt_ids: list[int] | None) -> str:
    data = chunk.model_dump(mode="json")
    data["choices"][0]["token_ids"] = list(ids)
    if prompt_ids is not None:
        data["choices"][0]["prompt_token_ids"] = list(prompt_ids)
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
        await asyncio.gather(*tasks, return_exceptions=True)
