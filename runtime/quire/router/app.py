"""The router's ASGI app.

    /v1/completions /v1/chat/completions /v1/models[/{id}] /generate /tokenize /detokenize
                     proxied
    /health /ready   200 while the process runs (with no replica it holds, it does not fail)
    /metrics         the router's own metrics (see metrics.py)
    /router/state    the same figures as JSON: pending, idle seconds, replicas and their load
    /router/backends POST/DELETE {"url": ...}: add or remove a replica (only with --admin-api)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from quire.router.metrics import CONTENT_TYPE
from quire.router.proxy import ProxyEndpoint, RouterState, error_body
from quire.router.request_tracing import traced

logger = logging.getLogger(__name__)

PROXIED = {"/v1/completions": ["POST"], "/v1/chat/completions": ["POST"], "/generate": ["POST"],
           "/tokenize": ["POST"], "/detokenize": ["POST"], "/v1/models": ["GET"],
           "/v1/models/{model_id:path}": ["GET"]}


def build_app(state: RouterState, background=(), admin_api: bool = False,
              tracer=None, services=()) -> Starlette:
    """`background`: coroutine functions run for the app's lifetime (load scraping,
    discovery); a failure in one is logged and the others go on. `tracer`: an OpenTelemetry
    tracer for a span per proxied generation request (request_tracing.py), or None.
    `services`: servers with async start() and stop() (the ext_proc endpoint picker) that
    share this loop; one that cannot start stops the router's start."""

    @asynccontextmanager
    async def lifespan(app):
        started = []
        try:
            for service in services:
                await service.start()
                started.append(service)
        except BaseException:
            for service in reversed(started):
                await service.stop()
            raise
        tasks = [asyncio.ensure_future(_logged(fn)) for fn in background]
        try:
            yield
        finally:
            for service in reversed(started):
                await service.stop()
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await state.client.aclose()

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request):
        return Response(state.metrics.render(state.backends), media_type=CONTENT_TYPE)

    async def router_state(request: Request):
        events = getattr(state.policy, "events_index", None)  # precise-prefix routing
        extra = {} if events is None else {
            "kv_events": {"blocks": len(events), "events": events.num_events}}
        return JSONResponse({**extra,
            "pending_requests": state.holding.pending,
            "flow_control_queued": state.flow.queued if state.flow is not None else 0,
            "flow_control_releases": state.flow.recent_releases() if state.flow is not None else [],
            "idle_seconds": round(time.time() - state.metrics.last_request_time, 3),
            "routing": state.policy.name,
            "backends": [{"url": b.url, "in_flight": b.in_flight, "waiting": b.waiting,
                          "running": b.running, "kv_cache_usage": b.kv_usage,
                          "load": b.load(), "down": b.down,
                          "models": sorted(b.models) if b.models is not None else None}
                         for b in state.backends.all()]})

    async def backends(request: Request):
        try:
            url = (await request.json())["url"]
            if not isinstance(url, str) or not url:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return Response(error_body(400, 'send {"url": "http://host:port"}', "bad_request"),
                            400, media_type="application/json")
        if request.method == "POST":
            state.backends.add(url)
        else:
            state.backends.remove(url)
        return JSONResponse({"backends": [b.url for b in state.backends.all()]})

    proxy = traced(ProxyEndpoint(state), tracer)
    routes = [Route("/health", health), Route("/ready", health), Route("/metrics", metrics),
              Route("/router/state", router_state)]
    if admin_api:
        routes.append(Route("/router/backends", backends, methods=["POST", "DELETE"]))
    routes += [Route(path, proxy, methods=methods) for path, methods in PROXIED.items()]
    return Starlette(routes=routes, lifespan=lifespan)


async def _logged(fn) -> None:
    try:
        await fn()
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("router background task %s failed", getattr(fn, "__name__", fn))
