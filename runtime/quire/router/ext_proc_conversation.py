"""One HTTP request's ext_proc conversation: when to read the body, when to answer what.

The destination must reach Envoy before it sends the request headers on to its router, and
it depends on the body (model, prompt). How that fits depends on the gateway's request body
mode, which Envoy names in the first message's `protocol_config`:

- BUFFERED, BUFFERED_PARTIAL: Envoy waits for the headers' answer (CONTINUE), then sends the
  body in one message and holds the headers until that is answered: the destination goes
  into the body's answer.
- FULL_DUPLEX_STREAMED (GIE's mode, and what we assume when the gateway does not say): the
  body's chunks come without waiting; the headers' answer is held until the last chunk, then
  carries the destination, followed by the body itself, chunk by chunk (Envoy keeps no copy
  in this mode).
- STREAMED with send_body_without_waiting_for_header_response: the same hold; each chunk then
  gets its own CONTINUE.
- STREAMED without it, and NONE: the headers must be answered before any body is seen, so
  load alone decides (logged once: configure the gateway with one of the modes above).

A request without a body (headers with end_of_stream) is routed on its headers. The response
direction is passed through unchanged. A body that cannot be routed (not JSON, no prompt)
gets a 400, no ready replica a 503 (ImmediateResponse); the replica's in-flight count holds
the request from the pick until the conversation ends, as the proxy's does.
"""

from __future__ import annotations

import logging

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from quire.router import ext_proc_messages as msg
from quire.router.endpoint_picking import (
    BadRequestBody,
    EndpointPicker,
    NoEndpoint,
    endpoint_of,
    parse_request_body,
)
from quire.router.ext_proc_messages import Mode

logger = logging.getLogger(__name__)

BUFFERED_MODES = (Mode.BUFFERED, Mode.BUFFERED_PARTIAL)
_warned_unroutable_mode = False


class Conversation:
    def __init__(self, picker: EndpointPicker, retry_after: int) -> None:
        self.picker = picker
        self.retry_after = retry_after
        # What an unannounced gateway gets: GIE's processing modes.
        self.request_mode = Mode.FULL_DUPLEX_STREAMED
        self.response_mode = Mode.FULL_DUPLEX_STREAMED
        self.body_before_headers_answer = True
        self.path = "/"
        self.headers: dict[str, str] = {}  # the request's (objective and tenant headers)
        self.subset: list[str] | None = None
        self.chunks: list[bytes] = []
        self.headers_held = False  # their answer waits for the body
        self.backend = None   # the pick, once made (it holds an in-flight count)
        self.finished = False  # an ImmediateResponse was sent: nothing more to say

    async def answer(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The responses this message calls for, in order (none while a body is awaited)."""
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self.request_mode = config.request_body_mode
            self.response_mode = config.response_body_mode
            self.body_before_headers_answer = config.send_body_without_waiting_for_header_response \
                or config.request_body_mode == Mode.FULL_DUPLEX_STREAMED
        if message.HasField("metadata_context"):
            hint = msg.subset_hint(message.metadata_context)
            if hint is not None:
                self.subset = hint
        phase = message.WhichOneof("request")
        if phase == "request_headers":
            return await self._request_headers(message.request_headers)
        if phase == "request_body":
            return await self._request_body(message.request_body)
        if phase == "request_trailers":
            return await self._request_trailers()
        if phase == "response_body" and self.response_mode == Mode.FULL_DUPLEX_STREAMED:
            body = message.response_body
            return [msg.streamed_body(phase, body.body, body.end_of_stream)]
        return [msg.pass_through(phase)]

    def close(self) -> None:
        if self.backend is not None:
            self.backend.in_flight -= 1
            self.backend = None
            flow = self.picker.state.flow
            if flow is not None:
                flow.notify()  # room on that replica, perhaps, for a waiter

    # --- the request direction -----------------------------------------------------------
    async def _request_headers(self, headers: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self.headers = {k.lower(): v for k, v in msg.header_map(headers.headers).items()}
        self.path = self.headers.get(":path", "/").split("?", 1)[0]
        if headers.end_of_stream or self.request_mode == Mode.NONE:
            return await self._route(None, "request_headers")
        if self.request_mode in BUFFERED_MODES:
            return [msg.pass_through("request_headers")]
        if not self.body_before_headers_answer:
            _warn_unroutable_mode()
            return await self._route(None, "request_headers")
        self.headers_held = True  # answered with the destination once the body is in
        return []

    async def _request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        self.chunks.append(body.body)
        if self.backend is not None:  # routed on the headers (STREAMED): each chunk continues
            return [msg.pass_through("request_body")]
        if self.request_mode in BUFFERED_MODES:  # the one body message, partial or whole
            return await self._route_body("request_body", whole=body.end_of_stream)
        if not body.end_of_stream:
            return []
        return await self._route_body("request_headers", whole=True, body_ended=True)

    async def _request_trailers(self) -> list[pb.ProcessingResponse]:
        """Trailers end a body whose last chunk did not say so."""
        answers = []
        if self.headers_held:
            answers = await self._route_body("request_headers", whole=True, body_ended=False)
        if self.finished:
            return answers
        return answers + [msg.pass_through("request_trailers")]

    async def _route_body(self, phase: str, whole: bool,
                          body_ended: bool = True) -> list[pb.ProcessingResponse]:
        """Pick from the body read so far; `phase` is the message that carries the
        destination. A held headers answer is followed by the held body's answers."""
        raw = b"".join(self.chunks)
        try:
            body = parse_request_body(self.path, raw)
        except BadRequestBody as e:
            if whole:
                self.finished = True
                return [msg.immediate(400, str(e), "bad_request")]
            body = None  # the first part of a larger body (BUFFERED_PARTIAL): load decides
        answers = await self._route(body, phase)
        self.headers_held = False
        if self.finished or phase != "request_headers":
            return answers
        if self.request_mode == Mode.FULL_DUPLEX_STREAMED:  # sent on in Envoy's own chunks
            last = len(self.chunks) - 1
            return answers + [msg.streamed_body("request_body", chunk, body_ended and i == last)
                              for i, chunk in enumerate(self.chunks)]
        return answers + [msg.pass_through("request_body") for _ in self.chunks]

    async def _route(self, body: dict | None, phase: str) -> list[pb.ProcessingResponse]:
        try:
            choice = await self.picker.pick(self.path, body, self.subset, self.headers)
        except NoEndpoint as e:
            self.finished = True
            return [msg.immediate(e.status, str(e), e.reason, self.retry_after)]
        except BadRequestBody as e:  # an invalid priority
            self.finished = True
            return [msg.immediate(400, str(e), "bad_request")]
        self.backend = choice.backend
        self.backend.in_flight += 1
        return [msg.destination(endpoint_of(self.backend), phase)]


def _warn_unroutable_mode() -> None:
    global _warned_unroutable_mode
    if not _warned_unroutable_mode:
        _warned_unroutable_mode = True
        logger.warning("the gateway sends request bodies STREAMED and waits for the headers' "
                       "answer first: requests are routed by load alone (no prompt or model "
                       "seen). Use FULL_DUPLEX_STREAMED (GIE's mode) or BUFFERED.")
