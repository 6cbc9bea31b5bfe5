"""The HTTP server: a FastAPI app over one AsyncLLMEngine, one router per endpoint family.

    /v1/completions  /v1/chat/completions  /v1/models      OpenAI-compatible (`model` may
                                                           name a loaded LoRA adapter)
    /v1/load_lora_adapter  /v1/unload_lora_adapter         vLLM's, with --allow-runtime-lora
    /generate                                              vLLM's simple API (NUL-separated stream)
    /tokenize  /detokenize  /version
    /v1/embeddings  /score  /rerank                        the pooling runner (--runner pooling)
    /health   200 while the engine loop is alive (also while the model loads)
    /ready    200 once the model is loaded and the server admits requests, else 503
    /metrics  Prometheus text format

With an API key, everything but /health, /ready, /metrics and /version needs
`Authorization: Bearer KEY`. Every error is OpenAI's {"error": {...}} shape. The limits on
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

import quire
from quire.engine.async_engine import AsyncLLMEngine
from quire.entrypoints import memory
from quire.entrypoints.errors import OpenAIError, bad_request
from quire.entrypoints.limits import ServerLimits
from quire.entrypoints.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from quire.entrypoints.reasoning import get_reasoning_parser
from quire.entrypoints.routers import (
    chat,
    completions,
    embeddings,
    generate,
    lora,
    models,
    probes,
    score,
    tokenizer,
)
from quire.entrypoints.serving import Serving
from quire.entrypoints.tool_calls import get_tool_parser

logger = logging.getLogger(__name__)

ROUTERS = (probes, models, completions, chat, generate, tokenizer, embeddings, score)


def build_app(engine: AsyncLLMEngine, metrics=None, api_key: str | None = None,
              log_requests: bool = False, limits: ServerLimits | None = None,
              trim_memory: bool = True, tool_call_parser: str = "auto",
              allow_runtime_lora: bool = False,
              lora_parents: dict[str, str] | None = None,
              model_aliases: list[str] | tuple[str, ...] = (),
              reasoning_parser: str | None = None,
              default_template_kwargs: dict | None = None,
              tracer=None) -> FastAPI:
    """The app; its lifespan starts the engine (loading the model in the background) and
    shuts it down. `metrics` should be the engine's stats sink; `tool_call_parser` a
    TOOL_PARSERS name or "auto" (detected from the chat template). `allow_runtime_lora`
    registers the LoRA load/unload routes; `lora_parents`: adapter -> the parent
    /v1/models names (default: the base model's served name); `model_aliases`: more names
    for the base model (--served-model-name's second and later); `reasoning_parser` a
    REASONING_PARSERS name or None (no reasoning split); `default_template_kwargs`: chat
    template variables under every request's chat_template_kwargs; `tracer`: an
    OpenTelemetry tracer for a span per generation request (request_tracing.py), or None."""
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

    app = FastAPI(title="Quire", version=quire.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    app.state.started = int(time.time())
    for module in ROUTERS:
        app.include_router(module.router)
    if allow_runtime_lora:  # without it the routes don't exist: 404, as in vLLM
        app.include_router(lora.router)
    # the last added runs first: the key is checked before a byte of the body is read
    app.add_middleware(BodyLimitMiddleware, max_bytes=serving.limits.max_request_body_bytes,
                       timeout=serving.limits.request_body_timeout)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=probes.OPEN_PATHS)
    if tracer is not None:  # outermost: the span covers the whole request
        from quire.entrypoints.request_tracing import TracingMiddleware
        app.add_middleware(TracingMiddleware, tracer=tracer)
    _add_error_handlers(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return OpenAIError(e.status_code, str(e.detail), kind, None, e.status_code,
                           getattr(e, "headers", None)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        loc = [p for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        return bad_request(f"invalid request: {err.get('msg', e)}",
                           str(loc[0]) if loc else None).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return OpenAIError(500, f"internal server error: {type(e).__name__}", "server_error",
                           None, "internal_error").response()
