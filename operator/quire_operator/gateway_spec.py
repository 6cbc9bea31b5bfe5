"""`spec.gateway`: the Gateway API Inference Extension objects, parsed and validated.

    spec:
      router:
        enabled: true                # required: the router is the pool's endpoint picker
      gateway:
        inferencePool:
          enabled: true              # an InferencePool <name> over the runtime pods
          failureMode: FailClose     # FailOpen: the Gateway picks a pod itself when the router is down
        httpRoute:                   # only while the pool is on: its backend is the pool
          parentRefs:                # Gateways to attach an HTTPRoute <name> (backend: the pool) to
            - name: inference-gateway
              namespace: gateways
          hostnames: [llm.example.com]
          requestTimeout: 300s       # Gateway API Duration; generations outlast most defaults
        objectives:                  # InferenceObjectives on the pool (GIE's request priorities)
          - name: chat               # what clients send in x-gateway-inference-objective
            priority: 10             # higher first; below 0: sheddable (429 while saturated)
          - name: batch
            priority: -1

Errors are `SpecError`s naming the field, like the rest of the spec's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .router_spec import _section  # one reader of optional spec sections
from .spec_error import SpecError

FAILURE_MODES = ("FailOpen", "FailClose")
# Where the router serves Envoy ext_proc (gRPC) as the pool's endpoint picker: GIE's EPP default.
EXT_PROC_PORT = 9002
EXT_PROC_PORT_NAME = "grpc-ext-proc"
DEFAULT_REQUEST_TIMEOUT = "300s"
# Gateway API's own limits and patterns (HTTPRoute, gateway.networking.k8s.io/v1), checked here
# so that a bad value is reported against our field rather than as a rejected child.
MAX_PARENT_REFS = 32
MAX_OBJECTIVES = 32
INT32 = (-(2 ** 31), 2 ** 31 - 1)  # GIE's priority range (and the router's, the engine's)
MAX_HOSTNAMES = 16
DURATION = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")
HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_GROUP = re.compile(r"^$|" + _DNS_SUBDOMAIN.pattern)
_KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
# ParentReference's fields: (pattern, max length); name has no pattern, only a length.
_PARENT_REF_FIELDS = {"group": (_GROUP, 253), "kind": (_KIND, 63), "name": (None, 253),
                      "namespace": (_DNS_LABEL, 63), "sectionName": (_DNS_SUBDOMAIN, 253)}


@dataclass(frozen=True)
class GatewaySpec:
    inference_pool: bool = False
    failure_mode: str = "FailClose"
    parent_refs: tuple[dict, ...] = ()   # an HTTPRoute is written when this is not empty
    hostnames: tuple[str, ...] = ()
    request_timeout: str = DEFAULT_REQUEST_TIMEOUT
    # (name, priority) of each InferenceObjective to write; the router gets them as flags too
    objectives: tuple[tuple[str, int], ...] = ()

    @property
    def http_route(self) -> bool:
        return self.inference_pool and bool(self.parent_refs)


def _list(raw: Mapping[str, Any], key: str, path: str, maximum: int) -> list:
    value = raw.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(f"{path}.{key}", f"must be a list, not {type(value).__name__}")
    if len(value) > maximum:
        raise SpecError(f"{path}.{key}", f"has {len(value)} entries; at most {maximum} are allowed")
    return value


def parse_gateway_spec(raw_spec: Mapping[str, Any] | None, *, router_enabled: bool) -> GatewaySpec:
    spec = raw_spec or {}
    gateway = _section(spec, "gateway", "spec")
    pool = _section(gateway, "inferencePool", "spec.gateway")
    route = _section(gateway, "httpRoute", "spec.gateway")
    pool_path, route_path = "spec.gateway.inferencePool", "spec.gateway.httpRoute"

    enabled = pool.get("enabled", False)
    if not isinstance(enabled, bool):
        raise SpecError(f"{pool_path}.enabled", f"must be true or false, not {enabled!r}")
    if enabled and not router_enabled:
        raise SpecError(f"{pool_path}.enabled", "true needs router.enabled: true (the router is the "
                                                "pool's endpoint picker)")
    failure_mode = pool.get("failureMode", "FailClose")
    if failure_mode not in FAILURE_MODES:
        raise SpecError(f"{pool_path}.failureMode", f"{failure_mode!r} is not one of {', '.join(FAILURE_MODES)}")

    parent_refs = tuple(_parent_ref(ref, f"{route_path}.parentRefs[{i}]")
                        for i, ref in enumerate(_list(route, "parentRefs", route_path, MAX_PARENT_REFS)))
    # parentRefs with the pool off are kept, unused: the pool's switch turns the route (whose
    # backend it is) off with it, and back on with it
    hostnames = _list(route, "hostnames", route_path, MAX_HOSTNAMES)
    for i, hostname in enumerate(hostnames):
        if not isinstance(hostname, str) or len(hostname) > 253 or not HOSTNAME.match(hostname):
            raise SpecError(f"{route_path}.hostnames[{i}]", f"{hostname!r} is not a hostname (RFC 1123, "
                                                            "optionally prefixed with '*.'; no IPs)")
    timeout = route.get("requestTimeout", DEFAULT_REQUEST_TIMEOUT)
    if not isinstance(timeout, str) or not DURATION.match(timeout):
        raise SpecError(f"{route_path}.requestTimeout", f"{timeout!r} is not a Gateway API duration "
                                                        "(e.g. 300s, 5m, 1h30m)")
    objectives = _objectives(gateway, enabled)
    return GatewaySpec(inference_pool=enabled, failure_mode=failure_mode, parent_refs=parent_refs,
                       hostnames=tuple(hostnames), request_timeout=timeout, objectives=objectives)


def _objectives(gateway: Mapping[str, Any], pool_enabled: bool) -> tuple[tuple[str, int], ...]:
    path = "spec.gateway.objectives"
    raw = _list(gateway, "objectives", "spec.gateway", MAX_OBJECTIVES)
    if raw and not pool_enabled:
        raise SpecError(path, "needs inferencePool.enabled: true (objectives name the pool)")
    seen: dict[str, int] = {}
    for i, entry in enumerate(raw):
        here = f"{path}[{i}]"
        if not isinstance(entry, Mapping):
            raise SpecError(here, f"must be an object with name and priority, not {type(entry).__name__}")
        unknown = set(entry) - {"name", "priority"}
        if unknown:
            raise SpecError(f"{here}.{sorted(unknown)[0]}", "is not a field of an objective (allowed: name, priority)")
        name = entry.get("name")
        if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
            raise SpecError(f"{here}.name", f"{name!r} is not an object name (RFC 1123 subdomain)")
        if name in seen:
            raise SpecError(f"{here}.name", f"{name!r} is listed twice")
        priority = entry.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int) or not INT32[0] <= priority <= INT32[1]:
            raise SpecError(f"{here}.priority", f"must be an integer in [{INT32[0]}, {INT32[1]}] (higher is "
                                                f"served first; below 0 is sheddable), not {priority!r}")
        seen[name] = priority
    return tuple(seen.items())


def _parent_ref(ref: Any, path: str) -> dict:
    if not isinstance(ref, Mapping):
        raise SpecError(path, f"must be an object, not {type(ref).__name__}")
    unknown = set(ref) - set(_PARENT_REF_FIELDS)
    if unknown:
        raise SpecError(f"{path}.{sorted(unknown)[0]}", f"is not a field of a parent reference "
                                                        f"(allowed: {', '.join(_PARENT_REF_FIELDS)})")
    if not ref.get("name"):
        raise SpecError(f"{path}.name", "is required (the Gateway's name)")
    for key, (pattern, max_length) in _PARENT_REF_FIELDS.items():
        value = ref.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or len(value) > max_length or (pattern and not pattern.match(value)):
            raise SpecError(f"{path}.{key}", f"{value!r} is not a valid {key}")
    return dict(ref)
