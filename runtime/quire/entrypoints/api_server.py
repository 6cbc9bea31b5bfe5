"""The HTTP server: a FastAPI app over one AsyncLLMEngine, one router per endpoint family.

    /v1/completions  /v1/chat/completions  /v1/models      OpenAI-compatible (`model` may
    /v1/responses  GET /v1/responses/{id}                  name a loaded LoRA adapter)
    /v1/messages  /v1/messages/count_tokens                Anthropic's Messages API
    /v1/load_lora_adapter  /v1/unload_lora_adapter         vLLM's, with --allow-runtime-lora
    /generate                                              vLLM's simple API (NUL-separated stream)
    /tokenize  /detokenize  /version  /tokenizer_info (--enable-tokenizer-info-endpoint)
    /v1/embeddings  /score  /rerank                        the pooling runner (--runner pooling)
    /health   200 while the engine loop is alive (also while the model loads)
    /ready    200 once the model is loaded and the server admits requests, else 503
    /metrics  Prometheus text format

With an API key, everything but /health, /ready, /metrics and /version needs
`Authorization: Bearer KEY` (or `x-api-key: KEY`). Every error is OpenAI's {"error": {...}}
shape, but on /v1/messages Anthropic's {"type": "error", "error": {...}}. The limits on
what a client may send are in limits.py; CPU work runs in the tokenizer pool, never on the
event loop or the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from quire.engine.async_engine import AsyncLLMEngine
from quire.entrypoints import memory, openapi_docs
from quire.entrypoints.errors import OpenAIError, bad_request, error_response
from quire.entrypoints.limits import ServerLimits
from quire.entrypoints.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from quire.entrypoints.reasoning import get_reasoning_parser
from quire.entrypoints.routers import (
    chat,
    completions,
    embeddings,
    generate,
    lora,
    messages,
    models,
    probes,
    responses,
    score,
    tokenizer,
)
from quire.entrypoints.routers.common import add_body_schemas, client_gone_response
from quire.entrypoints.serving import ClientDisconnected, Serving
from quire.entrypoints.tool_calls import get_tool_parser
from quire.version import __version__

logger = logging.getLogger(__name__)

ROUTERS = (probes, models, completions, chat, responses, messages, generate, tokenizer,
           embeddings, score)


def build_app(engine: AsyncLLMEngine, metrics=None, api_key: str | None = None,
              log_requests: bool = False, limits: ServerLimits | None = None,
              trim_memory: bool = True, tool_call_parser: str = "auto",
              allow_runtime_lora: bool = False,
              lora_parents: dict[str, str] | None = None,
              model_aliases: list[str] | tuple[str, ...] = (),
              reasoning_parser: str | None = None,
              default_template_kwargs: dict | None = None,
              enable_tokenizer_info: bool = False,
              tracer=None) -> FastAPI:
    """The app; its lifespan starts the engine (loading the model in the background) and
    shuts it down. `metrics` should be the engine's stats sink; `tool_call_parser` a
    TOOL_PARSERS name or "auto" (detected from the chat template). `allow_runtime_lora`
    registers the LoRA load/unload routes; `lora_parents`: adapter -> the parent
    /v1/models names (default: the base model's served name); `model_aliases`: more names
    for the base model (--served-model-name's second and later); `reasoning_parser` a
    REASONING_PARSERS name or None (no reasoning split); `default_template_kwargs`: chat
    template variables under every request's chat_template_kwargs; `tracer`: an
    OpenTelemetry tracer for a span per generation request (request_tracing.py), or None;
    `enable_tokenizer_info` registers vLLM's GET /tokenizer_info."""
    if tool_call_parser != "auto":
        get_tool_parser(tool_call_parser)  # ValueError naming the choices
    serving = Serving(engine, limits or ServerLimits(), metrics, log_requests,
                      tool_call_parser, dict(lora_parents or {}), tuple(model_aliases),
                      reasoning_parser=get_reasoning_parser(reasoning_parser)
                      if reasoning_parser is not None else None,
                      default_template_kwargs=dict(default_template_kwargs or {}))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        trimmer = asyncio.create_task(memory.trim_when_idle(engine)) if trim_memory else None
        yield
        if trimmer is not None:
            trimmer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await trimmer
        await engine.shutdown()
        serving.shutdown()

    app = FastAPI(title="Quire", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.started = int(time.time())
    for module in ROUTERS:
        app.include_router(module.router)
    if allow_runtime_lora:  # without it the routes don't exist: 404, as in vLLM
        app.include_router(lora.router)
    if enable_tokenizer_info:  # the same: off unless asked for, as in vLLM
        app.include_router(tokenizer.info_router)
    # the last added runs first: the key is checked before a byte of the body is read
    app.add_middleware(BodyLimitMiddleware, max_bytes=serving.limits.max_request_body_bytes,
                       timeout=serving.limits.request_body_timeout)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=probes.OPEN_PATHS)
    if tracer is not None:  # outermost: the span covers the whole request
        from quire.entrypoints.request_tracing import TracingMiddleware
        app.add_middleware(TracingMiddleware, tracer=tracer)
    _add_error_handlers(app)
    openapi_docs.install(app)  # the endpoints' bodies, answers and errors
    _declare_bodies(app)  # and the bodies routes declare with json_body()
    return app


def _declare_bodies(app: FastAPI) -> None:
    """/openapi.json with the request bodies the routes parse themselves."""
    plain = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = add_body_schemas(plain())
        return app.openapi_schema

    app.openapi = openapi


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return error_response(e, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(e.status_code, str(e.detail), kind, None,
                                          e.status_code, getattr(e, "headers", None)),
                              request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        loc = [p for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        return error_response(bad_request(f"invalid request: {err.get('msg', e)}",
                                          str(loc[0]) if loc else None), request.url.path)

    @app.exception_handler(ClientDisconnect)
    async def _gone_mid_upload(request: Request, e: ClientDisconnect):
        # the client hung up before its body was whole: as quiet as any other disconnect
        request.app.state.serving.client_gone()
        return client_gone_response()

    @app.exception_handler(ClientDisconnected)
    async def _gone_while_waiting(request: Request, e: ClientDisconnected):
        # a whole answer's client left (Serving.finals aborted its requests): nobody reads this
        return client_gone_response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return error_response(OpenAIError(500, f"internal server error: {type(e).__name__}",
                                          "server_error", None, "internal_error"),
                              request.url.path)
