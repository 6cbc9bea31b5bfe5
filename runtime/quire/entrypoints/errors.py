"""The errors the server answers with, in OpenAI's shape (Anthropic's on the Messages API's
paths), and the one mapping from engine exceptions to HTTP answers (so "the engine is dead" is
503 wherever it is noticed).

Bad input's `param` is the field a QuireValidationError carries, never read out of a message:
a plain ValueError answers 400 with param null."""

from __future__ import annotations

from quire.engine.async_engine import (
    AdapterNotFound,
    EngineDeadError,
    EngineNotReady,
    EngineOverloaded,
    EngineShuttingDown,
    RequestFailed,
)
from quire.validation import field_of

RETRY_AFTER_QUEUE_FULL = "1"     # seconds: the queue moves every step
RETRY_AFTER_LOADING = "5"        # seconds: a model load takes a while


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self):
        from fastapi.responses import JSONResponse  # only the server needs fastapi
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# The Messages API's paths answer in Anthropic's shape, {"type": "error", "error": {"type",
# "message"}}, with Anthropic's error types for the same statuses.
ANTHROPIC_PATH_PREFIX = "/v1/messages"
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_body(e: OpenAIError) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(e.status) or (
        "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


def error_response(e: OpenAIError, path: str):
    """The HTTP answer to `e` in the shape the endpoint at `path` speaks."""
    if not speaks_anthropic(path):
        return e.response()
    from fastapi.responses import JSONResponse
    return JSONResponse(anthropic_body(e), status_code=e.status, headers=e.headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, "invalid_value")


def unsupported_media_type(content_type: str) -> OpenAIError:
    """vLLM's answer to a body that is not declared as JSON (its words, and 415)."""
    return OpenAIError(415, "Unsupported Media Type: Only 'application/json' is allowed "
                       f"(the request's Content-Type is {content_type!r})",
                       "invalid_request_error", None, "unsupported_media_type")


def server_busy(message: str) -> OpenAIError:
    return OpenAIError(503, message, "server_error", None, "server_busy",
                       {"Retry-After": RETRY_AFTER_QUEUE_FULL})


def invalid_input(e: ValueError, renames: dict[str, str] | None = None) -> OpenAIError:
    """The 400 for a library's ValueError, naming the field it carries as this endpoint's
    request calls it (`renames`, e.g. chat's prompt -> messages: the message is prefixed with
    the request's name, as the library's text names its own)."""
    param, message = field_of(e), str(e)
    if renames and param in renames:
        param = renames[param]
        message = f"{param}: {message}"
    return bad_request(message, param)


def engine_error(e: BaseException, renames: dict[str, str] | None = None) -> OpenAIError:
    """The HTTP answer to an exception from AsyncLLMEngine.add_request or a stream."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, AdapterNotFound):
        return model_not_found(e.name)
    if isinstance(e, ValueError):
        return invalid_input(e, renames)
    if isinstance(e, EngineOverloaded):
        return OpenAIError(503, str(e), "server_error", None, "queue_full",
                           {"Retry-After": RETRY_AFTER_QUEUE_FULL})
    if isinstance(e, EngineNotReady):
        return OpenAIError(503, str(e), "server_error", None, "model_loading",
                           {"Retry-After": RETRY_AFTER_LOADING})
    if isinstance(e, EngineShuttingDown):
        return OpenAIError(503, str(e), "server_error", None, "shutting_down")
    if isinstance(e, EngineDeadError):
        return engine_dead(str(e))
    if isinstance(e, RequestFailed):
        return OpenAIError(500, f"the request failed in the engine: {e}", "server_error",
                           None, "request_failed")
    raise e


def model_not_found(name: str) -> OpenAIError:
    """vLLM's answer to a `model` that is neither the base model nor a loaded adapter."""
    return OpenAIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model",
                       404)


def engine_dead(reason: str) -> OpenAIError:
    """The one answer once the engine loop has died: the pod is going away, retry elsewhere."""
    return OpenAIError(503, f"the engine has failed: {reason}", "server_error", None,
                       "engine_dead")
