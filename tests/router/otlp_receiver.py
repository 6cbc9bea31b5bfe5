"""Local OTLP trace receivers for the tracing tests: what an OpenTelemetry collector does with
spans, minus everything but keeping them.

    with GrpcReceiver() as rx:      # opentelemetry.proto's TraceService/Export over gRPC
        ... rx.url ...              # http://127.0.0.1:PORT, for --otlp-traces-endpoint
        span = rx.wait_for(lambda s: s.trace_id == ..., what="the server's span")
    with HttpReceiver() as rx:      # OTLP/HTTP protobuf at POST /v1/traces

Both decode the ExportTraceServiceRequest with the `opentelemetry-proto` package into `Span`s.
"""

from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

SPAN_KIND_SERVER = trace_pb2.Span.SPAN_KIND_SERVER
STATUS_ERROR = trace_pb2.Status.STATUS_CODE_ERROR


@dataclass
class Span:
    service: str
    name: str
    kind: int
    trace_id: str          # hex, as in a traceparent
    span_id: str
    parent_span_id: str    # "" for a root span
    attributes: dict
    status_code: int
    events: list = field(default_factory=list)  # (name, attributes)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(Span(
                    service=resource.get("service.name", ""), name=s.name, kind=s.kind,
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(),
                    attributes={a.key: _value(a.value) for a in s.attributes},
                    status_code=s.status.code,
                    events=[(e.name, {a.key: _value(a.value) for a in e.attributes})
                            for e in s.events]))
    return spans


class _Sink:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self.url = ""

    def add(self, spans: list[Span]) -> None:
        with self._lock:
            self.spans.extend(spans)

    def wait_for(self, predicate, what: str, timeout: float = 30.0) -> Span:
        """The first span received that `predicate` accepts, polled until `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = [s for s in self.spans if predicate(s)]
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no span for {what} after {timeout:.0f}s; received: "
                                     f"{[(s.service, s.name, s.trace_id) for s in self.spans]}")
            time.sleep(0.05)


class GrpcReceiver(_Sink):
    def __enter__(self) -> GrpcReceiver:
        import grpc
        sink = self

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the protocol's name
                sink.add(decode(request))
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(grace=None)


class HttpReceiver(_Sink):
    def __enter__(self) -> HttpReceiver:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                sink.add(decode(request))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
