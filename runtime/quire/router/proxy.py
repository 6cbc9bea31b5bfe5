"""One proxied request: hold if no replica is ready, pick one, forward, stream the answer back.

Plain ASGI, not a framework response: the client's disconnect must be seen while we wait for
a replica, while the replica thinks, and while it streams, and it must close the upstream
connection (which is how the replica learns to abort the request).

Retries: a request whose replica fails before sending the first byte of its body (refused
connection, a reset, a 503 from a full or loading replica) goes to another replica not yet
tried, up to `max_retries` times. Once a byte has reached the client, never: a stream that
breaks then ends with an error (an SSE error event, or a cut connection for other bodies).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field

import httpx

from quire.router import migration
from quire.router.backends import Backend, BackendSet
from quire.router.flow_control import FlowControl, Shed, WaitExpired
from quire.router.holding import Holding, HoldRejected
from quire.router.metrics import RouterMetrics
from quire.router.objectives import (
    BadPriority,
    ObjectiveTable,
    request_priority,
    tenant_of,
)
from quire.router.prompt_hashing import PromptHasher

logger = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 7.6.1), and those the HTTP client sets itself.
DROPPED_REQUEST_HEADERS = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length"})
DROPPED_RESPONSE_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade"})


class UpstreamBroke(Exception):
    """A replica failed after the client got bytes: the connection is cut, not retried."""


@dataclass
class RouterState:
    backends: BackendSet
    policy: object
    holding: Holding
    metrics: RouterMetrics
    client: httpx.AsyncClient
    hasher: PromptHasher | None = None
    max_retries: int = 2
    retry_after: int = 5
    flow: FlowControl | None = None       # waiting while every replica is saturated
    objectives: ObjectiveTable = field(default_factory=ObjectiveTable)
    tenant_header: str | None = None      # the flow-control fairness key's header
    migration_limit: int = 3              # other replicas a broken stream may go on on


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()


async def send_error(send, status: int, message: str, code: str,
                     retry_after: int | None = None, param: str | None = None) -> None:
    body = error_body(status, message, code, param)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive) -> bytes | None:
    """The whole request body, or None if the client left before sending it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Retry(Exception):
    def __init__(self, reason: str, response: tuple | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response  # (status, headers, body) of a 503 to pass on if all fail


def _json_of(scope, body: bytes):
    """A POST's parsed body, or None (not JSON: the replica answers it with a 400)."""
    if scope["method"] != "POST" or not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


class ProxyEndpoint:
    """The ASGI app for every proxied path."""

    def __init__(self, state: RouterState) -> None:
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        body = await _read_body(receive)
        if body is None:
            return
        finished = False

        async def tracked_send(message) -> None:
            nonlocal finished
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True  # (the server reports a disconnect once a response is done)

        work = asyncio.ensure_future(self._handle(scope, body, tracked_send))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done() and not finished:
                work.cancel()  # the client went away: cancelling closes the upstream stream
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            with contextlib.suppress(asyncio.CancelledError):
                await work
        if work.cancelled():
            logger.debug("client disconnected from %s", scope["path"])

    async def _handle(self, scope, body: bytes, send) -> None:
        st = self.state
        st.metrics.request_arrived()
        parsed = _json_of(scope, body)
        model = parsed.get("model") if isinstance(parsed, dict) else None  # the base model or a LoRA adapter
        headers = lowercase_headers(scope["headers"])
        try:
            priority, engine_priority = request_priority(headers, parsed, st.objectives,
                                                         st.metrics)
        except BadPriority as e:
            await send_error(send, 400, str(e), "bad_request", param="priority")
            return
        span = scope.get(SPAN_KEY)
        if span is not None:
            span.set_attribute("quire.request.priority", priority)  # GIE's scale (objectives.py)
        if engine_priority is not None:  # the objective's priority, for the replica's scheduler
            parsed = {**parsed, "priority": engine_priority}
            body = json.dumps(parsed).encode()
        stream = None
        if st.migration_limit > 0:
            stream = migration.for_request(scope["path"], parsed)
            if stream is not None:
                body = stream.forwarded_body()
        hashes = await self._hashes(scope, parsed)
        tried: set[str] = set()
        last_503 = None
        ticket = None
        try:
            for attempt in range(st.max_retries + 1):
                try:
                    await st.holding.until_backend()
                except HoldRejected as e:
                    st.metrics.rejected.labels(reason=e.reason).inc()
                    await send_error(send, 503, str(e), e.reason, st.retry_after)
                    return
                if attempt == 0 and st.flow is not None:
                    try:
                        ticket = await st.flow.admit(priority, tenant_of(headers, st.tenant_header))
                    except Shed as e:
                        await send_error(send, 429, str(e), "saturated", st.retry_after)
                        return
                    except WaitExpired as e:
                        st.metrics.rejected.labels(reason=e.reason).inc()
                        await send_error(send, 503, str(e), e.reason, st.retry_after)
                        return
                outcome, response = await self._attempt(scope, body, send, hashes, model, tried,
                                                        stream, ticket)
                if outcome == "answered":
                    return
                if outcome == "exhausted":
                    break
                last_503 = response or last_503
        finally:
            if st.flow is not None:
                st.flow.dispatched(ticket)
        if last_503 is not None:  # every replica was full or loading: say so, as they did
            status, headers, content = last_503
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content})
            return
        st.metrics.rejected.labels(reason="upstream_failed").inc()
        await send_error(send, 502, f"no replica could take the request (tried "
                                    f"{len(tried)})", "upstream_failed", st.retry_after)

    async def _attempt(self, scope, body, send, hashes, model, tried, stream,
                       ticket) -> tuple[str, tuple | None]:
        """One replica: ("answered", None), ("retry", a 503 to pass on or None), or
        ("exhausted", None) when every replica was tried."""
        st = self.state
        candidates = [b for b in st.backends.all() if b.url not in tried]
        if not candidates:
            return "exhausted", None
        # A LoRA adapter only some replicas have loaded goes to those (when none has, a replica's 404 says so).
        if isinstance(model, str):
            candidates = [b for b in candidates if b.may_serve(model)] or candidates
        candidates = [b for b in candidates if not b.cooling()] or candidates
        choice = st.policy.pick(candidates, hashes)
        st.metrics.decisions.labels(policy=st.policy.name, reason=choice.reason).inc()
        backend = choice.backend
        tried.add(backend.url)
        try:
            await self._forward(backend, scope, body, send, hashes, stream, ticket, tried)
            return "answered", None
        except _Retry as r:
            logger.info("%s failed before its first byte (%s); trying another replica if one "
                        "is left", backend.url, r.reason)
            st.metrics.retries.labels(reason=r.reason).inc()
            return "retry", r.response

    async def _hashes(self, scope, parsed) -> list[bytes]:
        hasher = self.state.hasher
        if hasher is None or parsed is None:
            return []
        return await asyncio.to_thread(hasher.hashes, scope["path"], parsed)

    def _request(self, backend: Backend, scope, body: bytes) -> httpx.Request:
        # the path as the client sent it, still percent-encoded: decoded, a control
        # character in it (a model id in /v1/models/{id}) is no URL httpx will send
        raw_path = scope.get("raw_path") or scope["path"].encode()
        url = backend.url + raw_path.decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in DROPPED_REQUEST_HEADERS]
        return self.state.client.build_request(scope["method"], url, headers=headers,
                                               content=body)

    async def _forward(self, backend: Backend, scope, body: bytes, send, hashes,
                       stream=None, ticket=None, tried=()) -> None:
        st = self.state
        request = self._request(backend, scope, body)
        backend.in_flight += 1
        if st.flow is not None:
            st.flow.dispatched(ticket)  # it counts on this replica now: the next may be judged
        try:
            try:
                response = await st.client.send(request, stream=True)
            except httpx.TransportError as e:
                backend.failed()
                if not isinstance(e, httpx.ConnectError):  # it had the request: a resend
                    st.metrics.migrations.labels(reason="connection_lost").inc()
                raise _Retry(type(e).__name__) from None
            try:
                await self._relay(response, send, backend, hashes, stream, scope, tried)
            finally:
                await response.aclose()  # unread: the connection closes and the replica aborts
        finally:
            backend.in_flight -= 1
            if st.flow is not None:
                st.flow.notify()

    async def _relay(self, response: httpx.Response, send, backend: Backend, hashes,
                     stream=None, scope=None, tried=()) -> None:
        st = self.state
        if stream is not None and (response.status_code != 200 or "text/event-stream"
                                   not in response.headers.get("content-type", "")):
            stream = None  # an error answer, or not a stream after all: passed on as it is
        headers = [(k.encode("latin-1"), v.encode("latin-1"))
                   for k, v in response.headers.multi_items()
                   if k.lower() not in DROPPED_RESPONSE_HEADERS]
        if response.status_code == 503:
            backend.failed()
            try:
                content = await response.aread()
            except httpx.TransportError as e:
                raise _Retry(type(e).__name__) from None
            raise _Retry("unavailable", (503, headers, content))
        chunks = response.aiter_raw()
        try:
            if scope is not None and self._resends_aborted(scope, response):
                first, more = await self._whole_unless_aborted(response, backend), False
            else:
                first = await chunks.__anext__()
                more = True
        except StopAsyncIteration:
            first, more = b"", False
        except httpx.TransportError as e:
            raise _Retry(type(e).__name__) from None
        # Committed to this replica from here on.
        st.metrics.first_byte()
        if response.status_code < 400:
            st.policy.routed(backend, hashes)
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": headers})
        if stream is not None:
            await send({"type": "http.response.body", "body": stream.feed(first),
                        "more_body": True})
            await self._relay_migrating(stream, chunks, send, backend, scope, set(tried))
            return
        await send({"type": "http.response.body", "body": first, "more_body": more})
        if not more:
            return
        try:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as e:
            logger.warning("%s broke off a response mid-stream: %s", backend.url, e)
            st.metrics.rejected.labels(reason="broken_stream").inc()
            if "text/event-stream" not in response.headers.get("content-type", ""):
                raise UpstreamBroke(f"{backend.url} failed mid-response") from None
            event = b"data: " + error_body(502, "the replica failed while streaming this "
                                                "response; it is incomplete",
                                           "upstream_failed") + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": False})
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # --- migration (migration.py) --------------------------------------------------------
    def _resends_aborted(self, scope, response: httpx.Response) -> bool:
        """A whole (not streamed) answer of a generation endpoint: read before it is passed
        on, so that one the replica aborted (a drain's timeout) is sent to another instead."""
        return (self.state.migration_limit > 0 and scope["path"] in migration.MIGRATABLE_PATHS
                and response.status_code == 200 and "content-encoding" not in response.headers
                and response.headers.get("content-type", "").startswith("application/json"))

    async def _whole_unless_aborted(self, response: httpx.Response, backend: Backend) -> bytes:
        content = b"".join([chunk async for chunk in response.aiter_raw()])
        try:
            choices = json.loads(content).get("choices") or []
        except (ValueError, AttributeError):
            return content
        if any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices):
            backend.failed()
            self.state.metrics.migrations.labels(reason="aborted").inc()
            raise _Retry("aborted")
        return content

    async def _relay_migrating(self, stream, chunks, send, backend: Backend, scope,
                               tried: set[str]) -> None:
        """The rest of a migratable stream: on to other replicas while it breaks, up to
        --migration-limit times; the client's response ends exactly once."""
        span = scope.get(SPAN_KEY)
        try:
            await self._migrate_while_broken(stream, chunks, send, backend, scope, tried, span)
        finally:  # a continuation's response, when the client left: its in-flight count too
            close = getattr(stream.chunks, "aclose", None)
            if close is not None:
                await close()

    async def _migrate_while_broken(self, stream, chunks, send, backend: Backend, scope,
                                    tried: set[str], span) -> None:
        st = self.state
        migrations = 0
        while True:
            await self._pass_events(stream, chunks, send, backend)
            if stream.done or stream.finished:
                tail = b"" if stream.done else b"data: [DONE]\n\n"
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                return
            reason = stream.broken or "connection_lost"
            tried.add(backend.url)
            if reason == "connection_lost":
                backend.failed()
            body = stream.continuation_body()
            if migrations >= st.migration_limit or body is None:
                break
            migrations += 1
            st.metrics.migrations.labels(reason=reason).inc()
            nxt = await self._continue_on(stream, body, scope, tried)
            if nxt is None:
                break
            logger.warning("%s: stream %s after %d tokens; continued on %s", backend.url,
                           reason, len(stream.token_ids), nxt[0].url)
            if span is not None:
                span.add_event("quire.migration", {"quire.migration.from": backend.url,
                                                   "quire.migration.to": nxt[0].url,
                                                   "quire.migration.reason": reason,
                                                   "quire.migration.tokens": len(stream.token_ids)})
            if stream.chunks is not None:  # the previous continuation's, given up
                await stream.chunks.aclose()
            backend, chunks = nxt
            stream.chunks = chunks  # closed by _relay_migrating however it ends
        st.metrics.migration_failures.inc()
        st.metrics.rejected.labels(reason="broken_stream").inc()
        message = ("the replica streaming this response failed and no other replica could "
                   f"continue it (after {migrations} migration(s)); it is incomplete")
        event = b"data: " + error_body(502, message, "upstream_failed") + b"\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": False})

    async def _pass_events(self, stream, chunks, send, backend: Backend) -> None:
        if stream.broken or stream.done:  # (already in the first bytes)
            return
        try:
            async for chunk in chunks:
                out = stream.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if stream.broken or stream.done:
                    return
        except httpx.TransportError as e:
            logger.warning("%s broke off a stream: %s", backend.url, e)

    async def _continue_on(self, stream, body: bytes, scope, tried: set[str]):
        """(replica, its chunk iterator) of a continuation that answered 200, or None."""
        st = self.state
        while True:
            candidates = [b for b in st.backends.all() if b.url not in tried]
            candidates = [b for b in candidates if not b.cooling()] or candidates
            if not candidates:
                return None
            backend = st.policy.pick(candidates, []).backend
            tried.add(backend.url)
            backend.in_flight += 1
            try:
                response = await st.client.send(self._request(backend, scope, body), stream=True)
            except httpx.TransportError:
                backend.in_flight -= 1
                backend.failed()
                continue
            if response.status_code != 200:
                logger.info("%s refused a continuation: %d", backend.url, response.status_code)
                await response.aclose()
                backend.in_flight -= 1
                continue
            stream.restart()
            return backend, self._owned_chunks(backend, response)

    async def _owned_chunks(self, backend: Backend, response: httpx.Response):
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            await response.aclose()
            backend.in_flight -= 1
            if self.state.flow is not None:
                self.state.flow.notify()


SPAN_KEY = "quire.router.span"  # request_tracing.py puts the router's span in the scope


def lowercase_headers(raw) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
