"""The router's span per proxied generation request (`quire router --otlp-traces-endpoint`).

`traced(proxy, tracer)` wraps the proxy's ASGI app: each POST to a generation endpoint gets a
SERVER span, a child of the client's W3C `traceparent` (a new trace without one), and the
request goes on to the replica with the router span's context in place of the client's, so
the replica's span is a child of the router's. The span ends when the response does; it
carries the HTTP method, path and status and the request's gen_ai.operation.name, and is an
error when the router answers 5xx itself or the proxy fails.
"""

from __future__ import annotations

from quire.tracing import (
    HTTP,
    OPERATIONS,
    GenAI,
    end_span,
    parent_context,
    server_span_kind,
    with_span_context,
)


def traced(app, tracer):
    """`app` itself without a tracer; else the app with a span per generation request."""
    return app if tracer is None else _TracedProxy(app, tracer)


class _TracedProxy:
    def __init__(self, app, tracer) -> None:
        self.app, self.tracer = app, tracer

    async def __call__(self, scope, receive, send) -> None:
        operation = OPERATIONS.get(scope["path"]) if scope["method"] == "POST" else None
        if operation is None:
            await self.app(scope, receive, send)
            return
        parent = parent_context(scope["headers"])
        span = self.tracer.start_span(
            f"POST {scope['path']}", context=parent, kind=server_span_kind(),
            attributes={GenAI.OPERATION: operation, HTTP.METHOD: "POST",
                        HTTP.PATH: scope["path"]})
        scope = {**scope, "headers": with_span_context(scope["headers"], span, parent),
                 "quire.router.span": span}  # the proxy records migrations on it
        status: int | None = None
        error: str | None = None

        async def traced_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except Exception as e:
            error = type(e).__name__
            span.record_exception(e)
            raise
        finally:
            end_span(span, status, error)
