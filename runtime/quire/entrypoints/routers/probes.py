"""/health, /ready, /metrics, /version: open without the API key, and never wait on the
engine or the tokenizer pool (a kubelet probe must get its answer at once)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from quire.engine.async_engine import EngineState
from quire.metrics import CONTENT_TYPE
from quire.version import __version__

router = APIRouter()
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})


@router.get("/health")
async def health(request: Request):
    engine = request.app.state.engine
    if engine.state is EngineState.DEAD:
        return JSONResponse({"status": "unhealthy", "error": engine.fatal_error}, 503)
    return {"status": "ok"}


NOT_READY_REASONS = {EngineState.LOADING: "loading the model",
                     EngineState.DRAINING: "shutting down", EngineState.STOPPED: "shutting down"}


@router.get("/ready")
async def ready(request: Request):
    engine = request.app.state.engine
    state = engine.state
    if state is EngineState.READY:
        return {"status": "ready", "model": engine.served_model_name}
    reason = engine.fatal_error if state is EngineState.DEAD else NOT_READY_REASONS[state]
    return JSONResponse({"status": "not ready", "reason": reason}, 503)


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    metrics = request.app.state.metrics
    body = metrics.render() if metrics is not None else b""
    return Response(body, media_type=CONTENT_TYPE)


@router.get("/version")
async def version():
    return {"version": __version__}
