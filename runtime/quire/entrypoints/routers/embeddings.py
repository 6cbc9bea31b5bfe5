"""/v1/embeddings (OpenAI's shape) on the pooling runner: one engine request per input, the
checkpoint's default prompt before each text, `dimensions` for matryoshka models (cut, then
renormalized), `encoding_format` float or base64 (float32 little-endian, as OpenAI's)."""

from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import APIRouter, Request

from quire.entrypoints.errors import bad_request, invalid_input
from quire.entrypoints.limits import check_count
from quire.entrypoints.pooling_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
)
from quire.entrypoints.routers.common import (
    disconnected,
    json_response,
    read_body,
    serving_of,
)
from quire.entrypoints.serving import Serving
from quire.outputs import RequestOutput
from quire.pooling.params import PoolingParams

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    serving = serving_of(request)
    req = await read_body(request, EmbeddingRequest)
    info, _ = serving.model_for(req.model, runner="pooling")
    inputs = _inputs(req.input, serving.limits)
    params = pooling_params(serving, req.dimensions, req.normalize)
    request_id = f"embd-{uuid.uuid4().hex}"
    finals = await embed_all(serving, request, request_id, inputs, params, "input",
                             req.checked_truncation())
    data = [EmbeddingData(index=i, embedding=_encoded(out.embedding, req.encoding_format))
            for i, out in enumerate(finals)]
    tokens = sum(len(out.prompt_token_ids) for out in finals)
    return json_response(EmbeddingResponse(
        id=request_id, model=req.model or info.served_name, data=data,
        usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)))


def pooling_params(serving: Serving, dimensions: int | None,
                   normalize: bool | None = None) -> PoolingParams:
    """PoolingParams for this server's model, or a 400 naming what it can't give."""
    serving.check_runner(PoolingParams())
    try:
        params = PoolingParams(dimensions=dimensions, normalize=normalize)
        serving.engine.model_info.pooler.check_dimensions(dimensions)
    except ValueError as e:
        raise invalid_input(e) from None
    return params


async def embed_all(serving: Serving, request: Request, request_id: str,
                    inputs: list[str | list[int]], params: PoolingParams,
                    param: str | list[str], truncate: int | None = None) -> list[RequestOutput]:
    """One embedding per input, in order (texts get the model's default prompt first); a
    400 naming `param` (or each input's own) for an input too long or out of the
    vocabulary."""
    info = serving.engine.model_info
    prompt = info.pooler.default_prompt if info.pooler is not None else ""
    names = [param] * len(inputs) if isinstance(param, str) else param
    ids = [await serving.prompt_ids(prompt + p if isinstance(p, str) else p, info, name,
                                    truncate=truncate)
           for p, name in zip(inputs, names)]
    streams = await serving.submit(request_id, ids, params)
    return await serving.finals(streams, disconnected(request))


def _inputs(value, limits) -> list[str | list[int]]:
    if isinstance(value, str):
        inputs = [value]
    elif not value:
        raise bad_request("input must not be empty", "input")
    elif isinstance(value[0], int):
        inputs = [value]
    else:
        inputs = list(value)
    check_count("input", inputs, limits.max_prompts_per_request, "max-prompts-per-request")
    if any(not p for p in inputs):
        raise bad_request("input must be a non-empty string or a non-empty list of token ids "
                          "(or a list of those)", "input")
    return inputs


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()
    return embedding
