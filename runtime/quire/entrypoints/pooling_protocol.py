"""Request and response bodies of the pooling endpoints: OpenAI's /v1/embeddings, vLLM's
/score and /rerank (Jina/Cohere's shape). Parsed strictly, as openai_protocol.py does."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from quire.entrypoints.openai_protocol import TruncateField, _Request


class EmbeddingRequest(TruncateField):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids or a list of lists of "
                    "token ids")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="'float' or 'base64'")
    dimensions: int | None = Field(None, description="a positive integer or null")
    # vLLM's: unit vectors or not (null: as the model's sentence-transformers files say)
    normalize: bool | None = Field(None, description="true, false or null")
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: float32 little-endian bytes


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreRequest(_Request):
    model: str | None = None
    text_1: str | list[str] = Field(description="a string or a list of strings")
    text_2: str | list[str] = Field(description="a string or a list of strings")


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(_Request):
    model: str | None = None
    query: str
    documents: list[str] = Field(description="a list of strings")
    top_n: int | None = Field(None, description="a positive integer or null")
    return_documents: bool = True


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int = 0


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
