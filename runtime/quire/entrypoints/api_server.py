"""The HTTP server: a FastAPI app over one AsyncLLMEngine.

    /v1/completions  /v1/chat/completions  /v1/models      OpenAI-compatible
    /generate                                              vLLM's simple API (NUL-separated stream)
    /tokenize  /detokenize  /version
    /health   200 while the engine loop is alive (also while the model loads)
    /ready    200 once the model is loaded and the server admits requests, else 503
    /metrics  Prometheus text format

With an API key, everything but /health, /ready, /metrics and /version needs
`Authorization: Bearer KEY`. Every error is OpenAI's {"error": {...}} shape.
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import quire
from quire.engine.async_engine import AsyncLLMEngine
from quire.entrypoints.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                               DetokenizeRequest, GenerateRequest, OpenAIError,
                                               TokenizeRequest, bad_request, parse_request)
from quire.entrypoints.openai_serving import Serving
from quire.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class ApiKeyMiddleware:
    """Plain ASGI (so streams and disconnect detection pass through untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        response = error_response(OpenAIError(
            401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
            "invalid_request_error", None, "invalid_api_key"))
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the response ends (a client that disconnects cancels
    the sending task, which may leave the generator suspended): that runs the generator's
    `finally`, which aborts the engine requests."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def _disconnect_waiter(request: Request):
    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    return wait


def _respond(result, media_type: str | None = None) -> Response:
    if result is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    if isinstance(result, dict):
        return JSONResponse(result)
    return ClosingStreamingResponse(result, media_type=media_type)


def build_app(engine: AsyncLLMEngine, metrics: ServerMetrics | None = None,
              api_key: str | None = None, log_requests: bool = False) -> FastAPI:
    """The app; its lifespan starts the engine (loading the model in the background) and
    shuts it down. `metrics` should be the engine's stats sink."""
    serving = Serving(engine, log_requests)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="Quire", version=quire.__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIError(e.status_code, str(e.detail), kind, None,
                                          e.status_code, getattr(e, "headers", None)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        loc = [p for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        return error_response(bad_request(f"invalid request: {err.get('msg', e)}",
                                          str(loc[0]) if loc else None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        logger.exception("unhandled error serving %s %s", request.method, request.url.path)
        return error_response(OpenAIError(500, f"internal server error: {type(e).__name__}",
                                          "server_error", None, "internal_error"))

    async def body_of(request: Request, cls):
        return parse_request(cls, await request.body())

    # --- probes and metrics --------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "unhealthy", "error": engine.fatal_error}, 503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if engine.ready:
            return {"status": "ready", "model": engine.served_model_name}
        if not engine.alive:
            reason = engine.fatal_error
        elif not engine.accepting:
            reason = "shutting down"
        else:
            reason = "loading the model"
        return JSONResponse({"status": "not ready", "reason": reason}, 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": quire.__version__}

    # --- OpenAI-compatible ---------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        serving.check_model(None)
        return {"object": "list", "data": [{
            "id": serving.model_name, "object": "model", "created": started,
            "owned_by": "quire", "root": engine.engine.model_name, "parent": None,
            "max_model_len": engine.engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await body_of(request, CompletionRequest)
        return _respond(await serving.completions(req, _disconnect_waiter(request)),
                        "text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await body_of(request, ChatCompletionRequest)
        return _respond(await serving.chat(req, _disconnect_waiter(request)),
                        "text/event-stream")

    # --- vLLM's simple API ---------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        req = await body_of(request, GenerateRequest)
        return _respond(await serving.generate(req, _disconnect_waiter(request)))

    # --- tokenizer -----------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await body_of(request, TokenizeRequest)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        if req.messages is not None:
            tokens = serving.chat_prompt(req.messages, req.add_generation_prompt)
        else:
            tokens = list(engine.tokenizer(req.prompt,
                                           add_special_tokens=req.add_special_tokens).input_ids)
        return {"count": len(tokens), "max_model_len": engine.engine.max_model_len,
                "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await body_of(request, DetokenizeRequest)
        serving.check_model(req.model)
        vocab = engine.engine.model_config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens must be token ids in [0, {vocab}), got {bad}", "tokens")
        return {"prompt": serving.detokenize(req.tokens)}

    return app

