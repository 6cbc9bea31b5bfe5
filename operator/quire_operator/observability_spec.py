"""`spec.observability`: where the runtime and router pods send their traces.

    spec:
      observability:
        otlpEndpoint: http://otel-collector.observability:4317   # an OTLP collector;
                                                  # http:// plaintext, https:// TLS
        otlpProtocol: grpc                        # or http/protobuf (default grpc)

With an endpoint, the runtime pods get `--otlp-traces-endpoint` and so does the router
(spec.router), plus OTEL_EXPORTER_OTLP_TRACES_PROTOCOL and OTEL_SERVICE_NAME (the
LLMDeployment's name; `<name>-router` for the router) unless spec.env sets them. Errors are
`SpecError`s naming the field, like the rest of the spec's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .spec_error import SpecError

PROTOCOLS = ("grpc", "http/protobuf")
# The CRD's pattern: an http(s) URL with a host, no spaces.
ENDPOINT = re.compile(r"^https?://[^\s/?#]+(/\S*)?$")
MAX_ENDPOINT_LENGTH = 2048
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"


@dataclass(frozen=True)
class ObservabilitySpec:
    otlp_endpoint: str | None = None
    otlp_protocol: str = "grpc"


def parse_observability_spec(raw_spec: Mapping[str, Any] | None) -> ObservabilitySpec:
    path = "spec.observability"
    section = (raw_spec or {}).get("observability")
    if section is None:
        return ObservabilitySpec()
    if not isinstance(section, Mapping):
        raise SpecError(path, f"must be an object, not {type(section).__name__}")
    endpoint = section.get("otlpEndpoint")
    if endpoint is not None and (not isinstance(endpoint, str) or len(endpoint) > MAX_ENDPOINT_LENGTH
                                 or not ENDPOINT.match(endpoint)):
        raise SpecError(f"{path}.otlpEndpoint", f"{endpoint!r} must be an http:// or https:// URL "
                                                f"with a host (an OTLP collector)")
    protocol = section.get("otlpProtocol", "grpc")
    if protocol not in PROTOCOLS:
        raise SpecError(f"{path}.otlpProtocol", f"{protocol!r} is not one of {', '.join(PROTOCOLS)}")
    return ObservabilitySpec(otlp_endpoint=endpoint, otlp_protocol=protocol)


def tracing_args(spec: ObservabilitySpec) -> list[str]:
    """The runtime's and the router's flag for the endpoint (none without one)."""
    return ["--otlp-traces-endpoint", spec.otlp_endpoint] if spec.otlp_endpoint else []


def tracing_env(spec: ObservabilitySpec, service_name: str, env: tuple[dict, ...] = ()) -> list[dict]:
    """The protocol and service name for the OpenTelemetry SDK, except what `env` (spec.env)
    sets already."""
    if not spec.otlp_endpoint:
        return []
    taken = {item.get("name") for item in env}
    wanted = [{"name": PROTOCOL_ENV, "value": spec.otlp_protocol},
              {"name": SERVICE_NAME_ENV, "value": service_name}]
    return [item for item in wanted if item["name"] not in taken]
