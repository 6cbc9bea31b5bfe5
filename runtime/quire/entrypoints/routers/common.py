"""What the routers share: the Serving of the app, the parsed body, the disconnect watch."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from quire.entrypoints.errors import unsupported_media_type
from quire.entrypoints.openai_protocol import parse_request
from quire.entrypoints.serving import Serving

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it

# request models that routes declare with json_body(): added to the OpenAPI components
BODY_MODELS: list[type] = []


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


def json_body(cls) -> dict:
    """A route's openapi_extra declaring `cls` as its JSON body: the handler parses the body
    itself (strictly, with 400s naming the field), so FastAPI can't see it otherwise."""
    if cls not in BODY_MODELS:
        BODY_MODELS.append(cls)
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{cls.__name__}"}}}}}


def add_body_schemas(openapi: dict) -> dict:
    """The OpenAPI document with the json_body() models (and the models they use) in its
    components."""
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    for cls in BODY_MODELS:
        schema = cls.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas[cls.__name__] = schema
    return openapi


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
