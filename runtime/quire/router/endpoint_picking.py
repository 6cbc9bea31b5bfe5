"""One routing decision without proxying: what the ext_proc endpoint picker asks for.

    picker = EndpointPicker(state)             # the HTTP mode's own RouterState
    choice = await picker.pick("/v1/completions", body, subset=None)
    endpoint_of(choice.backend)                # "10.0.0.7:8000"

The same steps as the proxy's first attempt (proxy.py): the request counts as received (the
operator's idle signal), waits in the same hold while no replica is known, keeps to replicas
that list its `model` and are not cooling off, and the routing policy picks and records the
prefix. Both modes share the backends, their load, the prefix index and the metrics.

`parse_request_body` is the strict reading of the body that the picker needs: a gateway gets
a 400 that names the field, where the proxy would let the replica answer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

from quire.router.backends import Backend
from quire.router.flow_control import Shed, WaitExpired
from quire.router.holding import HoldRejected
from quire.router.objectives import BadPriority, request_priority, tenant_of
from quire.router.policies import Choice
from quire.router.proxy import RouterState

COMPLETIONS = "/completions"
CHAT = "/chat/completions"


class BadRequestBody(ValueError):
    """The body cannot be routed; the message names what is wrong."""


class NoEndpoint(Exception):
    """No replica may take the request now (a 503; 429 for a shed sheddable request)."""

    def __init__(self, reason: str, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.reason = reason  # the rejected-requests metric's label
        self.status = status


def endpoint_of(backend: Backend) -> str:
    """The replica as the gateway names endpoints: "ip:port" ("[v6]:port")."""
    parts = urlsplit(backend.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_request_body(path: str, raw: bytes) -> dict:
    """The JSON object of an OpenAI-style request, or BadRequestBody naming what is wrong.
    Completions need a `prompt`, chat completions `messages`; `model` and `cache_salt` are
    optional strings (other endpoints are checked for JSON and those two only)."""
    if not raw.strip():
        raise BadRequestBody("the request body is empty: send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequestBody(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequestBody(f"the request body must be a JSON object, not {_json_type(body)}")
    for name in ("model", "cache_salt"):
        value = body.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            raise BadRequestBody(f"{name}: must be a non-empty string, got {_json_type(value)}")
    if path.endswith(CHAT):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequestBody(f"messages: required for {path}, a non-empty list of "
                                 f"message objects (got {_json_type(messages)})")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise BadRequestBody(f"messages[{i}]: must be an object with role and content, "
                                     f"not {_json_type(message)}")
    elif path.endswith(COMPLETIONS):
        if not _is_prompt(body.get("prompt")):
            raise BadRequestBody(f"prompt: required for {path}: a string, a list of strings, "
                                 "a list of token ids or a list of such lists (got "
                                 f"{_json_type(body.get('prompt'))})")
    return body


class EndpointPicker:
    def __init__(self, state: RouterState) -> None:
        self.state = state

    async def pick(self, path: str, body: dict | None, subset: list[str] | None = None,
                   headers: dict[str, str] | None = None) -> Choice:
        """The replica for this request (body None: none was read; load alone decides).
        `subset`: the gateway's endpoint-subset hint, "ip:port" strings to choose among.
        `headers` (lower-case names): the objective and tenant headers flow control reads.
        Raises NoEndpoint when no replica may take it (after the hold, as in HTTP mode; a
        429 for a sheddable request while every replica is saturated, a 503 after the flow
        control's wait bound), BadRequestBody for an invalid priority."""
        st = self.state
        st.metrics.request_arrived()
        headers = headers or {}
        try:
            priority, _ = request_priority(headers, body, st.objectives, st.metrics)
        except BadPriority as e:
            raise BadRequestBody(f"priority: {e}") from None
        hashes = []
        if st.hasher is not None and body is not None:
            hashes = await asyncio.to_thread(st.hasher.hashes, path, body)
        try:
            await st.holding.until_backend()
        except HoldRejected as e:
            raise self._rejected(e.reason, str(e)) from None
        ticket = None
        if st.flow is not None:
            try:
                ticket = await st.flow.admit(priority, tenant_of(headers, st.tenant_header))
            except Shed as e:
                raise NoEndpoint("saturated", str(e), 429) from None
            except WaitExpired as e:
                raise self._rejected(e.reason, str(e)) from None
        try:
            return self._choose(path, body, subset, hashes)
        finally:
            # the conversation counts it on its replica at once: the next waiter may be judged
            if st.flow is not None:
                st.flow.dispatched(ticket)

    def _choose(self, path: str, body: dict | None, subset: list[str] | None,
                hashes: list[bytes]) -> Choice:
        st = self.state
        candidates = st.backends.all()
        if subset is not None:
            wanted = set(subset)
            candidates = [b for b in candidates if endpoint_of(b) in wanted]
            if not candidates:
                raise self._rejected("subset_unavailable",
                                     "no ready replica is in the gateway's endpoint subset "
                                     f"({', '.join(subset) or 'empty'})")
        model = body.get("model") if body is not None else None
        # As in the proxy: an adapter only some replicas list goes to those; cooling ones last.
        if isinstance(model, str):
            candidates = [b for b in candidates if b.may_serve(model)] or candidates
        candidates = [b for b in candidates if not b.cooling()] or candidates
        choice = st.policy.pick(candidates, hashes)
        st.metrics.decisions.labels(policy=st.policy.name, reason=choice.reason).inc()
        # Recorded now: the gateway, not the router, will see whether the replica answered.
        st.policy.routed(choice.backend, hashes)
        return choice

    def _rejected(self, reason: str, message: str) -> NoEndpoint:
        self.state.metrics.rejected.labels(reason=reason).inc()
        return NoEndpoint(reason, message)


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt):
        return True
    return _is_token_ids(prompt)


def _is_token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _json_type(value: Any) -> str:
    if value is None:
        return "nothing"
    if value == "":
        return "an empty string"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)
