"""Plain-ASGI middleware (streams and disconnect detection pass through untouched): the API
key, and the request body's size and time limits."""

from __future__ import annotations

import asyncio
import hmac

from quire.entrypoints.errors import OpenAIError, error_response
from quire.entrypoints.limits import body_too_large, body_too_slow


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY` (what the anthropic SDK
    and Claude Code send)."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_x_api_key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        x_api_key = headers.get(b"x-api-key")
        if hmac.compare_digest(given, self.expected) or (
                x_api_key is not None and hmac.compare_digest(x_api_key,
                                                              self.expected_x_api_key)):
            await self.app(scope, receive, send)
            return
        response = error_response(OpenAIError(
            401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or "
                 "'x-api-key: <key>')", "invalid_request_error", None, "invalid_api_key"),
            scope["path"])
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
            await error_response(body_too_large(self.max_bytes), scope["path"])(
                scope, receive, send)
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
