"""OpenTelemetry traces for `quire serve` and `quire router` (`--otlp-traces-endpoint`).

    tracing = start_tracing(ns.otlp_traces_endpoint, "quire")   # None: tracing is off
    span = tracing.tracer.start_span(..., context=parent_context(scope["headers"]))
    tracing.shutdown()                                           # flushes what is queued

Tracing is on when `--otlp-traces-endpoint URL` is given (vLLM's flag) or, without it, when
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set. The OpenTelemetry SDK and its OTLP exporters (the
`otel` extra) are imported only then, so a server without tracing never loads them. The
exporter's protocol is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or OTEL_EXPORTER_OTLP_PROTOCOL):
`grpc` (the default, as in vLLM) or `http/protobuf`. Everything else is the SDK's own reading
of the standard variables: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (the service is
`quire` or `quire-router` unless they name one), OTEL_EXPORTER_OTLP_TRACES_HEADERS /
_INSECURE / _CERTIFICATE / _COMPRESSION / _TIMEOUT, OTEL_BSP_* (batching), OTEL_PROPAGATORS
(W3C trace context and baggage by default), OTEL_TRACES_SAMPLER.

The span attribute names are OpenTelemetry's GenAI semantic conventions, plus vLLM's
`gen_ai.latency.*` and `gen_ai.request.id` / `gen_ai.request.n`, so a trace of Quire reads
like one of vLLM.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "grpc"
# OTLP/HTTP's path for traces; an endpoint given without a path gets it
HTTP_TRACES_PATH = "/v1/traces"
OTEL_EXTRA_HINT = "pip install 'quire[otel]'"

# The generation endpoints that get a span each, and their gen_ai.operation.name.
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
              "/generate": "text_completion", "/v1/responses": "chat", "/v1/messages": "chat"}


class GenAI:
    """Span attribute names: the GenAI semantic conventions, then vLLM's additions."""
    OPERATION = "gen_ai.operation.name"
    PROVIDER = "gen_ai.provider.name"
    REQUEST_MODEL = "gen_ai.request.model"
    RESPONSE_MODEL = "gen_ai.response.model"
    RESPONSE_ID = "gen_ai.response.id"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TEMPERATURE = "gen_ai.request.temperature"
    TOP_P = "gen_ai.request.top_p"
    TOP_K = "gen_ai.request.top_k"
    SEED = "gen_ai.request.seed"
    INPUT_TOKENS = "gen_ai.usage.input_tokens"
    OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    # vLLM's (vllm/tracing SpanAttributes), not yet in the conventions
    REQUEST_ID = "gen_ai.request.id"
    N = "gen_ai.request.n"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    PREFILL = "gen_ai.latency.time_in_model_prefill"
    DECODE = "gen_ai.latency.time_in_model_decode"
    INFERENCE = "gen_ai.latency.time_in_model_inference"


class HTTP:
    METHOD = "http.request.method"
    PATH = "url.path"
    STATUS = "http.response.status_code"
    ERROR_TYPE = "error.type"


class TracingUnavailable(ValueError):
    """Tracing was asked for but cannot start (the SDK is missing, or a setting is bad)."""


def add_tracing_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--otlp-traces-endpoint", default=None, metavar="URL",
        help="send a span per generation request to this OTLP collector, e.g. "
             "http://otel-collector:4317 (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset: "
             "no tracing). Protocol from $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc (default) "
             "or http/protobuf; the other OTEL_* variables are honoured")


@dataclass
class Tracing:
    tracer: object          # opentelemetry.trace.Tracer
    provider: object        # opentelemetry.sdk.trace.TracerProvider
    endpoint: str
    protocol: str

    def shutdown(self) -> None:
        """Export what is still queued, then stop the exporter."""
        try:
            self.provider.shutdown()
        except Exception:  # noqa: BLE001 - a collector that is gone must not fail the exit
            logger.warning("flushing traces to %s failed", self.endpoint, exc_info=True)


def traces_endpoint(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The endpoint tracing uses, or None for no tracing."""
    value = flag if flag is not None else environ.get(ENDPOINT_ENV, "")
    return value.strip() or None


def traces_protocol(environ: Mapping[str, str] = os.environ) -> str:
    for key in PROTOCOL_ENVS:
        value = environ.get(key, "").strip()
        if value:
            if value not in PROTOCOLS:
                raise TracingUnavailable(f"{key}={value!r} is not supported; use one of "
                                         f"{', '.join(PROTOCOLS)}")
            return value
    return DEFAULT_PROTOCOL


def check_endpoint(endpoint: str, protocol: str) -> str:
    """The endpoint the exporter gets: an http(s) URL (grpc:// too for gRPC, as vLLM's docs
    write it); OTLP/HTTP's /v1/traces is added to a URL without a path."""
    parts = urlsplit(endpoint)
    schemes = ("http", "https", "grpc") if protocol == "grpc" else ("http", "https")
    if parts.scheme not in schemes or not parts.hostname:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint {endpoint!r} must be a URL with a host and one of the "
            f"schemes {', '.join(s + '://' for s in schemes)} (protocol {protocol})")
    if protocol == "http/protobuf" and parts.path in ("", "/"):
        return endpoint.rstrip("/") + HTTP_TRACES_PATH
    return endpoint


def start_tracing(flag: str | None, service_name: str,
                  environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """A tracer exporting over OTLP, or None when no endpoint is set."""
    endpoint = traces_endpoint(flag, environ)
    if endpoint is None:
        return None
    protocol = traces_protocol(environ)
    endpoint = check_endpoint(endpoint, protocol)
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP {protocol} "
            f"exporter, which are not installed ({e}); {OTEL_EXTRA_HINT}") from None
    from quire.version import __version__

    resource = Resource.create({SERVICE_VERSION: __version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    logger.info("tracing on: spans of service %s to %s (OTLP %s)",
                resource.attributes.get(SERVICE_NAME), endpoint, protocol)
    return Tracing(provider.get_tracer("quire", __version__), provider, endpoint,
                   protocol)


# --- context propagation (W3C traceparent by default: OTEL_PROPAGATORS) --------------------

def parent_context(headers: Iterable[tuple[bytes, bytes]]):
    """The caller's trace context from ASGI headers (an empty context if none came)."""
    from opentelemetry import propagate
    carrier: dict[str, str] = {}
    for key, value in headers:
        name = key.decode("latin-1").lower()
        text = value.decode("latin-1")
        carrier[name] = f"{carrier[name]},{text}" if name in carrier else text
    return propagate.extract(carrier)


def with_span_context(headers: list[tuple[bytes, bytes]], span,
                      parent=None) -> list[tuple[bytes, bytes]]:
    """ASGI headers whose trace context is `span`'s: the caller's traceparent (and whatever
    else the propagators write) replaced, so the next hop's span is a child of `span`."""
    from opentelemetry import propagate, trace
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span, parent))
    written = {k.lower().encode("latin-1") for k in carrier}
    kept = [(k, v) for k, v in headers if k.lower() not in written]
    return kept + [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]


def server_span_kind():
    from opentelemetry.trace import SpanKind
    return SpanKind.SERVER


def end_span(span, status_code: int | None, error: str | None = None) -> None:
    """Set the HTTP status (5xx or `error` is the span's error) and end the span."""
    from opentelemetry.trace import Status, StatusCode
    if status_code is not None:
        span.set_attribute(HTTP.STATUS, status_code)
    if error is None and status_code is not None and status_code >= 500:
        error = str(status_code)
    if error is not None:
        span.set_attribute(HTTP.ERROR_TYPE, error)
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
