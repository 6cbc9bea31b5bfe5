"""What the routers share: the Serving of the app, the parsed body, the disconnect watch."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from quire.entrypoints.errors import unsupported_media_type
from quire.entrypoints.openai_protocol import parse_request
from quire.entrypoints.serving import Serving

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


def serving_of(request: Request) -> Serving:
    return request.app.state.serving


async def read_body(request: Request, cls):
    """The body parsed as `cls` (400 naming the field); its size was bounded before it was
    read (the body-limit middleware). A body declared as anything but JSON is vLLM's 415,
    before it is read (no Content-Type at all is taken as JSON)."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise unsupported_media_type(content_type)
    return parse_request(cls, await request.body())


def disconnected(request: Request):
    """A coroutine function that returns once the client has gone away."""
    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    return wait


def client_gone_response() -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def json_response(model) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")
