"""What /openapi.json says about each endpoint: its request body (the same pydantic model the
endpoint parses with), its answers (JSON and, for streams, their media types) and its errors
(OpenAI's error shape), so generated clients, API gateways and fuzzers learn the API from it.

The endpoints read their bodies themselves (openai_protocol.parse_request: strict JSON, a 400
naming the field), so FastAPI would document none of them; `install` adds what each one takes
and answers to the generated schema, from the table below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from quire.entrypoints.anthropic_protocol import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from quire.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ErrorInfo,
    GenerateRequest,
    TokenizeRequest,
)
from quire.entrypoints.pooling_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from quire.entrypoints.responses_protocol import ResponseObject, ResponsesRequest
from quire.metrics import CONTENT_TYPE as PROMETHEUS_TEXT

REF = "#/components/schemas/{model}"
SSE = "text/event-stream"
# one server-sent event, as clients (and schemathesis) read it: its fields, `data` a JSON text
SSE_EVENT = {"type": "object", "properties": {"event": {"type": "string"},
                                              "data": {"type": "string"},
                                              "id": {"type": "string"}}}
GENERATE_STREAM = "application/octet-stream"  # /generate's stream: NUL-separated JSON texts


# --- answers that have no model of their own in the endpoints ------------------------------
class ErrorResponse(BaseModel):
    """Every error's body: OpenAI's {"error": {...}}."""
    error: ErrorInfo


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Errors on /v1/messages*: Anthropic's {"type": "error", "error": {...}}."""
    type: str = "error"
    error: AnthropicErrorInfo


class DeletedResponse(BaseModel):
    id: str
    object: str = "response"
    deleted: bool


class GenerateResponse(BaseModel):
    text: list[str]  # per sample: the prompt's text, then the generated text


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class Status(BaseModel):
    status: str
    model: str | None = None
    reason: str | None = None
    error: str | None = None


class Version(BaseModel):
    version: str


@dataclass(frozen=True)
class Operation:
    body: type[BaseModel] | None = None        # the JSON request body
    answer: type[BaseModel] | None = None      # the 200's JSON
    media: dict[str, str] = field(default_factory=dict)  # other 200 media types: description
    errors: tuple[int, ...] = ()
    error_model: type[BaseModel] | None = None  # the errors' body (None: OpenAI's shape)


ERROR_MEANINGS = {
    400: "Bad input: the message names the parameter (`param`).",
    401: "A missing or wrong API key (`Authorization: Bearer KEY`).",
    404: "A `model` that is neither the served model nor a loaded LoRA adapter.",
    408: "The request body took longer than --request-body-timeout to arrive.",
    413: "A body over --max-request-body-bytes.",
    415: "A body declared as anything but application/json.",
    500: "The request failed inside the engine (the message says why).",
    503: "Not ready: the model is loading, the server is draining, the queue is full or the "
         "engine has failed (Retry-After where waiting helps).",
}
GENERATION_ERRORS = (400, 401, 404, 408, 413, 415, 500, 503)
BODY_ERRORS = (400, 401, 404, 408, 413, 415, 503)

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/v1/completions", "post"): Operation(
        CompletionRequest, CompletionResponse,
        {SSE: "With stream: true, server-sent events of text_completion chunks, then "
              "`data: [DONE]`."}, GENERATION_ERRORS),
    ("/v1/chat/completions", "post"): Operation(
        ChatCompletionRequest, ChatCompletionResponse,
        {SSE: "With stream: true, server-sent events of chat.completion.chunk objects, then "
              "`data: [DONE]`."}, GENERATION_ERRORS),
    ("/generate", "post"): Operation(
        GenerateRequest, GenerateResponse,
        {GENERATE_STREAM: "With stream: true, {\"text\": [...]} JSON texts (the text so far), "
                          "each followed by a NUL byte."}, GENERATION_ERRORS),
    ("/tokenize", "post"): Operation(TokenizeRequest, TokenizeResponse, {}, BODY_ERRORS),
    ("/detokenize", "post"): Operation(DetokenizeRequest, DetokenizeResponse, {}, BODY_ERRORS),
    ("/v1/responses", "post"): Operation(
        ResponsesRequest, ResponseObject,
        {SSE: "With stream: true, the Responses API's events (response.created, ..., "
              "response.completed), each with its sequence_number."}, GENERATION_ERRORS),
    ("/v1/responses/{response_id}", "get"): Operation(None, ResponseObject, {},
                                                      (401, 404, 503)),
    ("/v1/responses/{response_id}", "delete"): Operation(None, DeletedResponse, {},
                                                         (401, 404, 503)),
    ("/v1/messages", "post"): Operation(
        MessagesRequest, MessageResponse,
        {SSE: "With stream: true, Anthropic's events (message_start, content_block_*, "
              "message_delta, message_stop, ping)."}, GENERATION_ERRORS,
        error_model=AnthropicErrorResponse),
    ("/v1/messages/count_tokens", "post"): Operation(
        CountTokensRequest, TokenCount, {}, BODY_ERRORS, error_model=AnthropicErrorResponse),
    ("/v1/embeddings", "post"): Operation(EmbeddingRequest, EmbeddingResponse, {},
                                          GENERATION_ERRORS),
    **{(path, "post"): Operation(ScoreRequest, ScoreResponse, {}, GENERATION_ERRORS)
       for path in ("/score", "/v1/score")},
    **{(path, "post"): Operation(RerankRequest, RerankResponse, {}, GENERATION_ERRORS)
       for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
    ("/v1/models", "get"): Operation(None, ModelList, {}, (401, 503)),
    ("/v1/models/{model_id}", "get"): Operation(None, ModelCard, {}, (401, 404, 503)),
    ("/health", "get"): Operation(None, Status, {}, (503,)),
    ("/ready", "get"): Operation(None, Status, {}, (503,)),
    ("/version", "get"): Operation(None, Version, {}, ()),
    ("/metrics", "get"): Operation(None, None, {PROMETHEUS_TEXT.split(";")[0]:
                                                "Prometheus' text exposition format."}, ()),
}


def install(app: FastAPI, operations: dict[tuple[str, str], Operation] = OPERATIONS) -> None:
    """Make app.openapi() document `operations` (those of its routes that exist)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document(get_openapi(title=app.title, version=app.version,
                                                      routes=app.routes), operations)
        return app.openapi_schema
    app.openapi = openapi


def document(schema: dict, operations: dict[tuple[str, str], Operation]) -> dict:
    models = {ErrorResponse}
    for (path, method), op in operations.items():
        target = schema.get("paths", {}).get(path, {}).get(method)
        if target is None:
            continue  # not served by this app (the LoRA routes are optional)
        target.pop("requestBody", None)
        if op.body is not None:
            models.add(op.body)
            target["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": REF.format(model=op.body.__name__)}}}}
        content = {}
        if op.answer is not None:
            models.add(op.answer)
            content["application/json"] = {"schema": {"$ref": REF.format(
                model=op.answer.__name__)}}
        for media, description in op.media.items():
            content[media] = {"schema": SSE_EVENT | {"description": description}
                              if media == SSE else {"type": "string",
                                                    "description": description}}
        responses = {"200": {"description": "OK", "content": content}}
        error_model = op.error_model or ErrorResponse
        if op.errors:
            models.add(error_model)
        for status in op.errors:
            responses[str(status)] = {"description": ERROR_MEANINGS[status], "content": {
                "application/json": {"schema": {"$ref": REF.format(
                    model=error_model.__name__)}}}}
        target["responses"] = responses
    _, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m:
                                                                         m.__name__)],
                                 ref_template=REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    for name in [n for n in ("HTTPValidationError", "ValidationError") if n in components]:
        del components[name]  # FastAPI's 422, which this server never answers
    return schema
