"""The Envoy ext_proc messages the endpoint picker reads and writes (PyPI's xds-protos).

What GIE's endpoint picker protocol fixes (docs/proposals/004-endpoint-picker-protocol in
kubernetes-sigs/gateway-api-inference-extension): the picked replica goes back both as the
request header `x-gateway-destination-endpoint: ip:port` and as dynamic metadata
`envoy.lb` / `x-gateway-destination-endpoint` with the same value; the gateway may restrict the
choice with filter metadata `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`
(a list of "ip:port"); no ready endpoint is a 503 ImmediateResponse.
"""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from quire.router.proxy import error_body

DESTINATION_KEY = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

Mode = processing_mode_pb2.ProcessingMode  # Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED, ...


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Lower-cased names to values (Envoy sends values in raw_value; older senders in value)."""
    return {h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value
            for h in headers.headers}


def subset_hint(metadata: base_pb2.Metadata) -> list[str] | None:
    """The gateway's endpoint subset ("ip:port" strings), or None when it sets none."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    value = metadata.filter_metadata[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if value is None:
        return None
    if value.WhichOneof("kind") == "list_value":
        return [v.string_value.strip() for v in value.list_value.values if v.string_value.strip()]
    return [e.strip() for e in value.string_value.split(",") if e.strip()]


def destination(endpoint: str, phase: str) -> pb.ProcessingResponse:
    """The answer that routes the request to `endpoint`: to the request headers, or (buffered
    body modes, where Envoy holds the headers until the body is answered) to the body."""
    header = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION_KEY, raw_value=endpoint.encode()),
        # a client's own x-gateway-destination-endpoint is replaced, never kept beside ours
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[header]),
                               clear_route_cache=True)
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_KEY: endpoint}})
    answer = pb.HeadersResponse(response=common) if phase.endswith("headers") \
        else pb.BodyResponse(response=common)
    return pb.ProcessingResponse(**{phase: answer}, dynamic_metadata=metadata)


def pass_through(phase: str) -> pb.ProcessingResponse:
    """CONTINUE, unchanged, for any phase."""
    if phase.endswith("headers"):
        return pb.ProcessingResponse(**{phase: pb.HeadersResponse()})
    if phase.endswith("body"):
        return pb.ProcessingResponse(**{phase: pb.BodyResponse()})
    return pb.ProcessingResponse(**{phase: pb.TrailersResponse()})


def streamed_body(phase: str, body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """In FULL_DUPLEX_STREAMED mode Envoy keeps no copy: the server sends the body on."""
    mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
        body=body, end_of_stream=end_of_stream))
    return pb.ProcessingResponse(**{phase: pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=mutation))})


def immediate(status: int, message: str, code: str,
              retry_after: int | None = None) -> pb.ProcessingResponse:
    """The gateway answers the client itself: the router's JSON error body (OpenAI's shape)."""
    headers = [base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]
    if retry_after is not None:
        headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="retry-after", raw_value=str(retry_after).encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=headers),
        body=error_body(status, message, code), details=f"quire_router_{code}"))

