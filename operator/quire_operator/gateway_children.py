"""The Gateway API Inference Extension objects `spec.gateway` adds, as pure functions.

    <name>   InferencePool (inference.networking.k8s.io/v1): the runtime pods on spec.port; its
             endpoint picker is the router's Service (<name>), ext_proc port 9002
    <name>   HTTPRoute (gateway.networking.k8s.io/v1), with spec.gateway.httpRoute.parentRefs:
             attaches the pool to those Gateways
    <objective>  InferenceObjective (inference.networking.x-k8s.io/v1alpha2) per entry of
             spec.gateway.objectives: its priority for requests whose
             x-gateway-inference-objective header names it (the router gets them as flags)

Each function returns None when the spec does not ask for its object; reconcile.py then deletes
it (`gateway_child_names`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from . import names
from .gateway_spec import EXT_PROC_PORT
from .spec import LLMSpec

INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_API = f"{INFERENCE_GROUP}/v1"
HTTP_ROUTE_API = "gateway.networking.k8s.io/v1"
INFERENCE_OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"


def _adopted(obj: dict, owner: Mapping[str, Any]) -> dict:
    kopf.adopt(obj, owner=owner)
    return obj


def gateway_runtime_args(spec: LLMSpec) -> list[str]:
    """Flags the runtime pods need behind an InferencePool: vLLM's metric names, which GIE's
    model-server protocol reads. A --metrics-compat in spec.runtime.extraArgs wins."""
    if not spec.gateway.inference_pool:
        return []
    if any(arg.split("=", 1)[0] == "--metrics-compat" for arg in spec.runtime.extra_args):
        return []
    return ["--metrics-compat", "vllm"]


def desired_inference_pool(owner: Mapping[str, Any], spec: LLMSpec) -> dict | None:
    if not spec.gateway.inference_pool:
        return None
    name = owner["metadata"]["name"]
    return _adopted({
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": {"name": name, "labels": names.child_labels(name)},
        "spec": {
            # Exactly this LLMDeployment's serving pods (a multi-node replica's leader).
            "selector": {"matchLabels": names.serving_selector_labels(name, spec.parallelism.multi_node)},
            "targetPorts": [{"number": spec.port}],
            # With spec.router on, the Service named after the LLMDeployment selects the router pods.
            "endpointPickerRef": {"group": "", "kind": "Service", "name": name,
                                  "port": {"number": EXT_PROC_PORT},
                                  "failureMode": spec.gateway.failure_mode},
        },
    }, owner)


def desired_http_route(owner: Mapping[str, Any], spec: LLMSpec) -> dict | None:
    if not spec.gateway.http_route:
        return None
    name = owner["metadata"]["name"]
    route_spec: dict[str, Any] = {
        "parentRefs": [dict(ref) for ref in spec.gateway.parent_refs],
        "rules": [{
            "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
            # No port: the pool's targetPorts say where its pods listen.
            "backendRefs": [{"group": INFERENCE_GROUP, "kind": "InferencePool", "name": name}],
            "timeouts": {"request": spec.gateway.request_timeout},
        }],
    }
    if spec.gateway.hostnames:
        route_spec["hostnames"] = list(spec.gateway.hostnames)
    return _adopted({
        "apiVersion": HTTP_ROUTE_API,
        "kind": "HTTPRoute",
        "metadata": {"name": name, "labels": names.child_labels(name)},
        "spec": route_spec,
    }, owner)


def desired_inference_objectives(owner: Mapping[str, Any], spec: LLMSpec) -> list[dict]:
    """One InferenceObjective per spec.gateway.objectives entry, named as clients will name it
    in the objective header, on this LLMDeployment's pool."""
    if not spec.gateway.inference_pool:
        return []
    pool = owner["metadata"]["name"]
    return [_adopted({
        "apiVersion": INFERENCE_OBJECTIVE_API,
        "kind": "InferenceObjective",
        "metadata": {"name": name, "labels": names.child_labels(pool)},
        "spec": {"poolRef": {"group": INFERENCE_GROUP, "kind": "InferencePool", "name": pool},
                 "priority": priority},
    }, owner) for name, priority in spec.gateway.objectives]


def gateway_children(owner: Mapping[str, Any], spec: LLMSpec) -> list[dict]:
    """What the spec asks for, in apply order (the pool before the route and the objectives
    that name it)."""
    return [obj for obj in (desired_inference_pool(owner, spec), desired_http_route(owner, spec)) if obj] \
        + desired_inference_objectives(owner, spec)


def gateway_child_names(name: str) -> list[tuple[str, str]]:
    """(kind, name) of everything gateway_children can make, the route first: what to delete."""
    return [("HTTPRoute", name), ("InferencePool", name)]
