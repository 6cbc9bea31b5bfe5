"""`spec.router` and scale to zero (`autoscaling.minReplicas: 0`): parsing and validation.

    spec:
      router:
        enabled: true           # default false: the Service points at the runtime pods
        replicas: 2             # router pods (default 1)
        routing: prefix-aware   # round-robin | least-load | prefix-aware (default) |
                                # precise-prefix (the replicas' KV-cache events, one router)
        maxPending: 256         # requests held while no replica is ready
        holdTimeoutSeconds: 300 # how long one is held before a 503
      autoscaling:
        minReplicas: 0          # scale to zero: needs the router (it holds the requests)
        idleWindowSeconds: 600  # no request for this long -> 0 replicas

The router reads a few runtime fields too (port, model, block size: it must hash prompts in
the blocks the replicas use), so `parse_router_spec` takes the whole spec. Errors are
`SpecError`s naming the field, like the rest of the spec's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .observability_spec import ObservabilitySpec
from .spec_error import SpecError
from .tls_spec import TLSSpec, parse_tls

ROUTING_POLICIES = ("round-robin", "least-load", "prefix-aware", "precise-prefix")
DEFAULT_BLOCK_SIZE = 16  # the runtime's default (EngineArgs.block_size)


@dataclass(frozen=True)
class RouterSpec:
    enabled: bool = False
    replicas: int = 1
    routing: str = "prefix-aware"
    max_pending: int = 256
    hold_timeout_seconds: float = 300.0
    # From the rest of the spec: where the replicas listen and how they cut prompts in blocks.
    runtime_port: int = 8000
    model_source: str | None = None
    model_revision: str | None = None
    model_pvc_claim: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    image: str | None = None
    image_pull_policy: str | None = None
    # spec.runtime.apiKeySecret when LoRA is on: the router reads the replicas' /v1/models with
    # it, to send an adapter's requests to the replicas that have it loaded.
    backend_api_key_secret: tuple[str, str] | None = None
    # spec.gateway.inferencePool: the router also serves Envoy ext_proc here, as the pool's
    # endpoint picker (gateway_children.py).
    ext_proc_port: int | None = None
    # spec.gateway.objectives: (name, priority) the router's flow control reads as --objective
    objectives: tuple[tuple[str, int], ...] = ()
    # spec.tls: the router serves HTTPS with the Secret and verifies the replicas with its CA.
    tls: TLSSpec = TLSSpec()
    # spec.observability: the router sends its spans there too.
    observability: ObservabilitySpec = field(default_factory=ObservabilitySpec)
    # spec.parallelism.pipeline > 1: only each group's leader pod serves (names.serving_selector_labels).
    leaders_only: bool = False


@dataclass(frozen=True)
class ScaleToZeroSpec:
    enabled: bool = False          # autoscaling.minReplicas == 0
    idle_window_seconds: int = 600


def _section(raw: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}.{key}", f"must be an object, not {type(value).__name__}")
    return value


def _int(raw: Mapping[str, Any], key: str, path: str, default: int, minimum: int,
         maximum: int | None = None) -> int:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path}.{key}", f"must be an integer, not {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"at least {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise SpecError(f"{path}.{key}", f"{value} must be {bound}")
    return value


def _number(raw: Mapping[str, Any], key: str, path: str, default: float, above: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > above:
        raise SpecError(f"{path}.{key}", f"must be a number greater than {above:g}, not {value!r}")
    return float(value)


def _bool(raw: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SpecError(f"{path}.{key}", f"must be true or false, not {value!r}")
    return value


def _string(raw: Mapping[str, Any], key: str) -> str | None:
    value = raw.get(key)
    return value if isinstance(value, str) and value.strip() else None


def parse_router_spec(raw_spec: Mapping[str, Any] | None) -> RouterSpec:
    """`spec.router` with defaults, plus the runtime fields the router needs."""
    spec = raw_spec or {}
    router = _section(spec, "router", "spec")
    path = "spec.router"
    routing = router.get("routing", "prefix-aware")
    if routing not in ROUTING_POLICIES:
        raise SpecError(f"{path}.routing", f"{routing!r} is not one of {', '.join(ROUTING_POLICIES)}")
    model = _section(spec, "model", "spec")
    runtime = _section(spec, "runtime", "spec")
    if routing == "precise-prefix" and _int(router, "replicas", path, 1, minimum=1, maximum=100) > 1:
        # each replica's publisher connects to one router pod through the Service
        raise SpecError(f"{path}.replicas", "precise-prefix routing runs one router (the replicas' "
                                            "KV-cache events reach one pod)")
    return RouterSpec(
        enabled=_bool(router, "enabled", path, False),
        replicas=_int(router, "replicas", path, 1, minimum=1, maximum=100),
        routing=routing,
        max_pending=_int(router, "maxPending", path, 256, minimum=0),
        hold_timeout_seconds=_number(router, "holdTimeoutSeconds", path, 300.0, above=0.0),
        runtime_port=_int(spec, "port", "spec", 8000, minimum=1, maximum=65535),
        model_source=_string(model, "source"),
        model_revision=_string(model, "revision"),
        model_pvc_claim=_string(_section(model, "pvc", "spec.model"), "claimName"),
        block_size=_int(runtime, "blockSize", "spec.runtime", DEFAULT_BLOCK_SIZE, minimum=1,
                        maximum=256),
        image=_string(router, "image") or _string(spec, "image"),
        image_pull_policy=_string(spec, "imagePullPolicy"),
        tls=parse_tls(spec),
    )


def parse_scale_to_zero(raw_spec: Mapping[str, Any] | None, router: RouterSpec) -> ScaleToZeroSpec:
    """minReplicas 0 is scale to zero; it needs the autoscaler (something must scale back up)
    and the router (something must hold requests while no replica runs)."""
    spec = raw_spec or {}
    scaling = _section(spec, "autoscaling", "spec")
    path = "spec.autoscaling"
    idle = _int(scaling, "idleWindowSeconds", path, 600, minimum=10, maximum=7 * 86400)
    if scaling.get("minReplicas") != 0:
        return ScaleToZeroSpec(False, idle)
    if not _bool(scaling, "enabled", path, False):
        raise SpecError(f"{path}.minReplicas", "0 needs autoscaling.enabled: true (nothing would "
                                               "scale the model back up)")
    if not router.enabled:
        raise SpecError(f"{path}.minReplicas", "0 needs router.enabled: true (the router holds "
                                               "requests while no replica runs)")
    return ScaleToZeroSpec(True, idle)
