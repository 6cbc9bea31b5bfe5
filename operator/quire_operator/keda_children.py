"""The KEDA ScaledObject `spec.autoscaling.provider: keda` asks for, as a pure function.

KEDA scales the LLMDeployment itself through its /scale subresource (as the built-in autoscaler
and HPA do), from the same two signals and targets as the built-in autoscaler, read from
Prometheus instead of each pod's /metrics:

    queue depth   sum over the pods of quire:num_requests_waiting (plus, with spec.router, the
                  requests the router holds for want of a replica), per replica: targetQueueDepth
    KV use        sum over the pods of quire:kv_cache_usage_perc, per replica:
                  targetKVCacheUtilization

Both are AverageValue triggers: HPA divides the sum by the replicas, so each target is per
replica, as in the built-in autoscaler. Prometheus must carry the pods' label
quire.dev/llmdeployment as `quire_dev_llmdeployment` (the chart's ServiceMonitor copies it;
the usual annotation-based scrape config's labelmap does too).

With minReplicas 0, a held request is queue depth: it activates the object from zero, and KEDA
scales back to zero after cooldownPeriod (spec.autoscaling.idleWindowSeconds) of neither.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from . import names
from .router_children import ROUTER_LABEL
from .spec import LLMSpec

SCALED_OBJECT_API = "keda.sh/v1alpha1"
# Prometheus's form of a Kubernetes label name: every character outside [a-zA-Z0-9_] becomes _.
POD_LABEL = "quire_dev_llmdeployment"
ROUTER_POD_LABEL = ROUTER_LABEL.replace(".", "_").replace("/", "_")
QUEUE_METRIC = "quire:num_requests_waiting"
KV_METRIC = "quire:kv_cache_usage_perc"
HELD_METRIC = "quire_router:pending_requests"
# HPA's limit on a scaling policy's period.
MAX_POLICY_PERIOD_SECONDS = 1800


def _adopted(obj: dict, owner: Mapping[str, Any]) -> dict:
    kopf.adopt(obj, owner=owner)
    return obj


def _selector(label: str, namespace: str, name: str) -> str:
    return f'{{namespace="{namespace}",{label}="{name}"}}'


def queue_query(namespace: str, name: str, with_router: bool) -> str:
    waiting = f"sum({QUEUE_METRIC}{_selector(POD_LABEL, namespace, name)})"
    if not with_router:
        return waiting
    # `or vector(0)`: at zero replicas there is no waiting series at all, and a sum of nothing
    # is no value rather than 0.
    held = f"sum({HELD_METRIC}{_selector(ROUTER_POD_LABEL, namespace, name)})"
    return f"({waiting} or vector(0)) + ({held} or vector(0))"


def kv_query(namespace: str, name: str) -> str:
    return f"sum({KV_METRIC}{_selector(POD_LABEL, namespace, name)})"


def _trigger(trigger_name: str, address: str, query: str, threshold: float) -> dict:
    return {
        "type": "prometheus",
        "name": trigger_name,
        "metricType": "AverageValue",
        # KEDA's trigger metadata is a map of strings.
        "metadata": {"serverAddress": address, "query": query, "threshold": f"{threshold:g}"},
    }


def desired_scaled_object(owner: Mapping[str, Any], spec: LLMSpec) -> dict | None:
    scaling = spec.autoscaling
    if not (scaling.enabled and scaling.provider == "keda"):
        return None
    meta = owner["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    address = scaling.keda_prometheus_address
    period = min(scaling.poll_interval_seconds, MAX_POLICY_PERIOD_SECONDS)
    return _adopted({
        "apiVersion": SCALED_OBJECT_API,
        "kind": "ScaledObject",
        "metadata": {"name": name, "labels": names.child_labels(name)},
        "spec": {
            "scaleTargetRef": {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": name},
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": scaling.poll_interval_seconds,
            "cooldownPeriod": spec.scale_to_zero.idle_window_seconds,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleUp": {"stabilizationWindowSeconds": scaling.scale_up_stabilization_seconds,
                            "policies": [{"type": "Pods", "value": scaling.max_scale_up_step,
                                          "periodSeconds": period}]},
                "scaleDown": {"stabilizationWindowSeconds": scaling.scale_down_stabilization_seconds},
            }}},
            "triggers": [
                _trigger("queue-depth", address, queue_query(namespace, name, spec.router.enabled),
                         scaling.target_queue_depth),
                _trigger("kv-cache-utilization", address, kv_query(namespace, name),
                         scaling.target_kv_cache_utilization),
            ],
        },
    }, owner)


def keda_child_names(name: str) -> list[tuple[str, str]]:
    return [("ScaledObject", name)]
