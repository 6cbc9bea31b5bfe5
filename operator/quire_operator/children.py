"""The objects one LLMDeployment owns, as pure functions of its body and parsed spec."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import kopf

from . import names
from .pod_template import pod_template
from .spec import LLMSpec


def owner_of(body: Mapping[str, Any]) -> dict:
    """The part of the LLMDeployment that adoption reads; a plain copy, so it can be kept."""
    meta = body.get("metadata", {})
    return {
        "apiVersion": body.get("apiVersion", names.API_VERSION),
        "kind": body.get("kind", names.KIND),
        "metadata": {key: copy.deepcopy(meta[key]) for key in ("name", "namespace", "uid", "labels") if key in meta},
    }


def _adopted(obj: dict, owner: Mapping[str, Any]) -> dict:
    """Owner reference, namespace and the owner's labels: deletion of the owner cascades."""
    kopf.adopt(obj, owner=owner)
    return obj


def initial_replicas(spec: LLMSpec) -> int:
    """The workload's replicas (pods, or a LeaderWorkerSet's groups)."""
    replicas = spec.replicas
    if spec.autoscaling.enabled and spec.autoscaling.max_replicas is not None:
        # spec.replicas is then only where the autoscaler starts; it corrects the count through
        # /scale at its first poll, but the first pods already respect the bounds.
        replicas = max(spec.autoscaling.min_replicas, min(spec.autoscaling.max_replicas, replicas))
    return replicas


def desired_deployment(owner: Mapping[str, Any], spec: LLMSpec, default_image: str) -> dict:
    name = owner["metadata"]["name"]
    # A rollout may wait for a model to load; the Deployment must not call that a failure.
    deadline = spec.runtime.startup_timeout_seconds + 300
    replicas = initial_replicas(spec)
    return _adopted({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": names.child_labels(name)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": names.selector_labels(name)},
            # Never drop below the serving capacity during a rollout; add one pod at a time.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": deadline,
            "template": pod_template(name, spec, default_image),
        },
    }, owner)


def desired_service(owner: Mapping[str, Any], spec: LLMSpec) -> dict:
    name = owner["metadata"]["name"]
    return _adopted({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": names.child_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": names.serving_selector_labels(name, spec.parallelism.multi_node),
            "ports": [{"name": names.PORT_NAME, "port": spec.port, "targetPort": names.PORT_NAME,
                       "protocol": "TCP"}],
        },
    }, owner)


def desired_pdb(owner: Mapping[str, Any], spec: LLMSpec) -> dict | None:
    if not spec.pdb_enabled:
        return None
    name = owner["metadata"]["name"]
    return _adopted({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": names.child_labels(name)},
        "spec": {
            "selector": {"matchLabels": names.selector_labels(name)},
            "maxUnavailable": spec.pdb_max_unavailable,
        },
    }, owner)


def endpoint(owner: Mapping[str, Any], spec: LLMSpec) -> str:
    meta = owner["metadata"]
    return f"{spec.tls.scheme}://{meta['name']}.{meta['namespace']}.svc:{spec.port}"


def desired_hash(obj: Mapping[str, Any]) -> str:
    """A digest of everything the operator sets. Equal on the live child: what differs there was
    changed by someone else (drift), not asked for by the spec."""
    content = copy.deepcopy(dict(obj))
    content.get("metadata", {}).get("annotations", {}).pop(names.HASH_ANNOTATION, None)
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def with_hash(obj: dict) -> dict:
    obj.setdefault("metadata", {}).setdefault("annotations", {})[names.HASH_ANNOTATION] = desired_hash(obj)
    return obj
