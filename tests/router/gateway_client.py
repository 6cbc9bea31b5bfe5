"""A stand-in for a Gateway's ext_proc client: Envoy's side of the endpoint picker stream.

    routed = await route("127.0.0.50:9002", "/v1/completions", body, mode=FULL_DUPLEX, chunks=3)
    routed.destination      # "127.0.0.51:40123", checked equal in header and metadata
    routed.status           # an ImmediateResponse's HTTP status, else None

It sends what Envoy sends in each request body mode and waits where Envoy waits: BUFFERED
answers the headers before the body is sent; FULL_DUPLEX_STREAMED and STREAMED (with
send_body_without_waiting_for_header_response) send every chunk first, then read the held
headers answer and the body's answers. The response direction follows when asked.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

BUFFERED = "BUFFERED"
STREAMED = "STREAMED"
FULL_DUPLEX = "FULL_DUPLEX_STREAMED"
DESTINATION = "x-gateway-destination-endpoint"
READ_TIMEOUT = 60.0  # an answer that never comes fails the test instead of hanging it


@dataclass
class Routed:
    responses: list[pb.ProcessingResponse]                # the request direction's answers
    response_answers: list[pb.ProcessingResponse] = field(default_factory=list)
    forwarded_body: bytes = b""                           # full duplex: the body sent back

    @property
    def status(self) -> int | None:
        last = self.responses[-1]
        return last.immediate_response.status.code if last.HasField("immediate_response") else None

    @property
    def error(self) -> dict:
        """An ImmediateResponse's JSON body and headers, for assertions."""
        immediate = self.responses[-1].immediate_response
        headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
        return {**json.loads(immediate.body)["error"], "headers": headers}

    @property
    def destination_phase(self) -> str:
        return next(r.WhichOneof("response") for r in self.responses if _destination_header(r))

    @property
    def destination(self) -> str:
        """The picked endpoint; the header and the envoy.lb metadata must agree (GIE)."""
        carrier = next(r for r in self.responses if _destination_header(r))
        header = _destination_header(carrier)
        metadata = carrier.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION]
        assert metadata.string_value == header, (header, metadata)
        return header


def _destination_header(response: pb.ProcessingResponse) -> str | None:
    phase = response.WhichOneof("response")
    if phase not in ("request_headers", "request_body"):
        return None
    for option in getattr(response, phase).response.header_mutation.set_headers:
        if option.header.key == DESTINATION:
            return option.header.raw_value.decode()
    return None


async def _read(call, routed: Routed) -> pb.ProcessingResponse:
    try:
        response = await asyncio.wait_for(call.read(), READ_TIMEOUT)
    except asyncio.TimeoutError:
        raise AssertionError(f"no answer from the picker in {READ_TIMEOUT:.0f}s after "
                             f"{[r.WhichOneof('response') for r in routed.responses]}") from None
    assert response is not grpc.aio.EOF, f"the picker closed the stream after {routed.responses}"
    return response


def request_headers(path: str, method: str, end_of_stream: bool,
                    extra: dict[str, str] | None = None) -> pb.HttpHeaders:
    pairs = [(":method", method), (":path", path), (":authority", "llm.example.com"),
             (":scheme", "http"), ("content-type", "application/json"),
             *(extra or {}).items()]
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
        end_of_stream=end_of_stream)


def _pieces(body: bytes, chunks: int) -> list[bytes]:
    size = max(1, -(-len(body) // chunks))
    return [body[i:i + size] for i in range(0, len(body), size)] or [b""]


async def route(target: str, path: str, body: bytes | None, mode: str = FULL_DUPLEX,
                chunks: int = 1, subset: list[str] | None = None, announce: bool = True,
                response_body: bytes | None = None,
                headers: dict[str, str] | None = None) -> Routed:
    """One request through the picker at `target` ("host:port"). `body` None: a GET without
    one. `announce`: send protocol_config as Envoy does (else the picker assumes GIE's mode).
    `response_body`: then play the replica's answer through (headers, one body chunk).
    `headers`: more request headers (an objective, a tenant)."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = ExternalProcessorStub(channel).Process()
        method = "GET" if body is None else "POST"
        first = pb.ProcessingRequest(request_headers=request_headers(path, method, body is None,
                                                                     headers))
        if announce:
            first.protocol_config.CopyFrom(pb.ProtocolConfiguration(
                request_body_mode=ProcessingMode.BodySendMode.Value(mode),
                response_body_mode=ProcessingMode.BodySendMode.Value(mode),
                send_body_without_waiting_for_header_response=mode == STREAMED))
        if subset is not None:
            first.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
                {"x-gateway-destination-endpoint-subset": subset})
        await call.write(first)
        routed = Routed([])
        if body is None:
            routed.responses.append(await _read(call, routed))
        elif mode == BUFFERED:
            routed.responses.append(await _read(call, routed))  # the headers first, as Envoy waits
            if routed.status is None:
                await call.write(pb.ProcessingRequest(
                    request_body=pb.HttpBody(body=body, end_of_stream=True)))
                routed.responses.append(await _read(call, routed))
        else:
            pieces = _pieces(body, chunks)
            for i, piece in enumerate(pieces):
                await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(
                    body=piece, end_of_stream=i == len(pieces) - 1)))
            await _read_request_answers(call, routed, mode, len(pieces))
        if routed.status is None and response_body is not None:
            await _play_response(call, routed, mode, response_body)
        await call.done_writing()
        return routed


async def _read_request_answers(call, routed: Routed, mode: str, pieces: int) -> None:
    """Until the held headers answer and every body answer came (or an ImmediateResponse)."""
    body_answers = 0
    while True:
        response = await _read(call, routed)
        routed.responses.append(response)
        if routed.status is not None:
            return
        if response.WhichOneof("response") != "request_body":
            continue
        body_answers += 1
        streamed = response.request_body.response.body_mutation.streamed_response
        routed.forwarded_body += streamed.body
        if (streamed.end_of_stream if mode == FULL_DUPLEX else body_answers == pieces):
            return


async def _play_response(call, routed: Routed, mode: str, body: bytes) -> None:
    await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status",
                                                                 raw_value=b"200")]))))
    routed.response_answers.append(await _read(call, routed))
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=body,
                                                                    end_of_stream=True)))
    routed.response_answers.append(await _read(call, routed))
