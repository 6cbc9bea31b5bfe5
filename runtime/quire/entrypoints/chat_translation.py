"""What the Responses and Anthropic Messages APIs share when they become a chat request: the
chat body validated with its errors named in the calling API's own field names, since a
client of /v1/messages sent `stop_sequences`, not `stop`.

    req = as_chat_request(body, RENAMES)      # a 400 names the caller's field
    with renamed_errors(RENAMES): ...         # chat's own 400s, re-labelled
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pydantic import ValidationError

from quire.entrypoints.errors import OpenAIError, bad_request
from quire.entrypoints.openai_protocol import ChatCompletionRequest


def as_chat_request(body: dict, renames: dict[str, str]) -> ChatCompletionRequest:
    """`body` as a ChatCompletionRequest; a value chat takes in a narrower type is a 400."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = renames.get(str(err["loc"][0]), str(err["loc"][0])) if err["loc"] else None
        raise bad_request(f"invalid '{param}': {err['msg']}", param) from None


@contextlib.contextmanager
def renamed_errors(renames: dict[str, str]) -> Iterator[None]:
    """Chat's 400s re-labelled with the calling API's field names."""
    try:
        yield
    except OpenAIError as e:
        if e.param in renames:
            old, e.param = e.param, renames[e.param]
            if e.message.startswith(old):
                e.message = e.param + e.message[len(old):]
        elif e.param is not None and e.param.startswith("messages[") and "messages" in renames:
            # a part of a message (an image's): the API's own field, which holds them all
            e.param = renames["messages"]
        raise
