"""vLLM's /score and /rerank for embedding models: each text embedded once on the pooling
runner, a pair's score the cosine similarity of its two embeddings (as vLLM scores pairs
with an embedding model). /rerank (also /v1/rerank, /v2/rerank) orders documents by it."""

from __future__ import annotations

import uuid

import torch
from fastapi import APIRouter, Request

from quire.entrypoints.errors import bad_request
from quire.entrypoints.limits import check_count
from quire.entrypoints.pooling_protocol import (
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from quire.entrypoints.routers.common import (
    json_response,
    read_body,
    serving_of,
)
from quire.entrypoints.routers.embeddings import embed_all, pooling_params

router = APIRouter()


@router.post("/score")
@router.post("/v1/score")
async def score(request: Request):
    serving = serving_of(request)
    req = await read_body(request, ScoreRequest)
    info, _ = serving.model_for(req.model, runner="pooling")
    firsts = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    seconds = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    for name, texts in (("text_1", firsts), ("text_2", seconds)):
        if not texts or any(not t for t in texts):
            raise bad_request(f"{name} must be a non-empty string or a non-empty list of "
                              "non-empty strings", name)
        check_count(name, texts, serving.limits.max_prompts_per_request,
                    "max-prompts-per-request")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise bad_request(f"text_1 and text_2 must be lists of the same length (or text_1 a "
                          f"single string); got {len(firsts)} and {len(seconds)}", "text_2")
    request_id = f"score-{uuid.uuid4().hex}"
    scores, tokens = await _cosines(request, request_id, firsts, seconds,
                                    ("text_1", "text_2"))
    return json_response(ScoreResponse(
        id=request_id, model=req.model or info.served_name,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(request: Request):
    serving = serving_of(request)
    req = await read_body(request, RerankRequest)
    info, _ = serving.model_for(req.model, runner="pooling")
    if not req.query:
        raise bad_request("query must be a non-empty string", "query")
    if not req.documents or any(not d for d in req.documents):
        raise bad_request("documents must be a non-empty list of non-empty strings",
                          "documents")
    check_count("documents", req.documents, serving.limits.max_prompts_per_request,
                "max-prompts-per-request")
    if req.top_n is not None and req.top_n < 1:
        raise bad_request(f"top_n must be a positive integer, got {req.top_n}", "top_n")
    request_id = f"rerank-{uuid.uuid4().hex}"
    scores, tokens = await _cosines(request, request_id, [req.query] * len(req.documents),
                                    req.documents, ("query", "documents"))
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=req.documents[i])
                            if req.return_documents else None) for i in order]
    return json_response(RerankResponse(id=request_id, model=req.model or info.served_name,
                                        usage=RerankUsage(total_tokens=tokens),
                                        results=results))


async def _cosines(request: Request, request_id: str, firsts: list[str], seconds: list[str],
                   names: tuple[str, str]) -> tuple[list[float], int]:
    """Each pair's cosine similarity (each distinct text embedded once), and the tokens
    embedded; `names`: the fields the two sides came from (a too-long text's 400 names it)."""
    serving = serving_of(request)
    field = {t: names[1] for t in seconds} | {t: names[0] for t in firsts}
    texts = list(dict.fromkeys(firsts + seconds))
    finals = await embed_all(serving, request, request_id, texts, pooling_params(serving, None),
                             [field[t] for t in texts])
    vectors = {t: torch.tensor(out.embedding) for t, out in zip(texts, finals)}
    scores = [torch.nn.functional.cosine_similarity(vectors[a], vectors[b], dim=0).item()
              for a, b in zip(firsts, seconds)]
    return scores, sum(len(out.prompt_token_ids) for out in finals)
