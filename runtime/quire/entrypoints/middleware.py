"""Plain-ASGI middleware (streams and disconnect detection pass through untouched): the API
key, and the request body's size and time limits."""

from __future__ import annotations

import asyncio
import hmac

from quire.entrypoints.errors import OpenAIError
from quire.entrypoints.limits import body_too_large, body_too_slow


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        response = OpenAIError(
            401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
            "invalid_request_error", None, "invalid_api_key").response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """A body declared bigger than the limit gets 413 before a byte of it is read; one that
    turns out bigger (chunked) gets 413 as soon as it passes the limit, and one that takes
    longer than `timeout` seconds to arrive gets 408. After the body, receive() is left
    alone (the disconnect watch waits on it for as long as the response takes)."""

    def __init__(self, app, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await body_too_large(self.max_bytes).response()(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        received = 0
        body_done = False

        async def limited_receive():
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise body_too_slow(self.timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise body_too_large(self.max_bytes)
                body_done = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)
