"""/generate, vLLM's simple API: {"text": [prompt + output, ...]}, whole or streamed as
NUL-separated JSON chunks holding the text so far."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from quire.engine.async_engine import EngineDeadError, RequestFailed
from quire.entrypoints.errors import engine_error
from quire.entrypoints.limits import check_stop
from quire.entrypoints.openai_protocol import GenerateRequest
from quire.entrypoints.openapi_docs import GENERATE_STREAM
from quire.entrypoints.routers.common import (
    disconnected,
    read_body,
    serving_of,
)
from quire.entrypoints.streaming import GuardedStreamingResponse, StreamGuard

router = APIRouter()


@router.post("/generate")
async def generate(request: Request):
    serving = serving_of(request)
    req = await read_body(request, GenerateRequest)
    info, lora = serving.model_for(req.model, runner="generate")
    check_stop(req.stop, req.stop_token_ids, serving.limits, info.vocab_size)
    params = req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs,
                                 stream=req.stream)
    ids = await serving.prompt_ids(req.prompt, info)
    prefix = req.prompt if isinstance(req.prompt, str) else await serving.pool.decode(ids)
    request_id = f"gen-{uuid.uuid4().hex}"
    streams = await serving.submit(request_id, [ids], params, lora_request=lora,
                                   cache_salt=req.cache_salt, priority=req.priority)
    if req.stream:
        guard = StreamGuard(serving, streams)
        return GuardedStreamingResponse(_chunks(serving, request_id, guard, params.n, prefix),
                                        guard, GENERATE_STREAM)
    out = (await serving.finals(streams, disconnected(request)))[0]
    outputs = sorted(out.outputs, key=lambda c: c.index)
    serving.log_done(request_id, sum(len(c.token_ids) for c in outputs), out.num_cached_tokens)
    return JSONResponse({"text": [prefix + c.text for c in outputs]})


async def _chunks(serving, request_id: str, guard: StreamGuard, n: int,
                  prefix: str) -> AsyncIterator[bytes]:
    texts = [prefix] * n
    tokens = cached = 0
    try:
        async for out in guard.streams[0]:
            cached = out.num_cached_tokens
            changed = False
            for c in out.outputs:
                tokens += len(c.token_ids)
                if c.text:
                    texts[c.index] += c.text
                    changed = True
            if changed or out.finished:
                yield (json.dumps({"text": texts}, ensure_ascii=False) + "\0").encode()
        serving.log_done(request_id, tokens, cached)
    except (RequestFailed, EngineDeadError) as e:
        yield (json.dumps(engine_error(e).body()) + "\0").encode()
    guard.completed = True
