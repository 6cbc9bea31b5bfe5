"""The objects `spec.router` adds to an LLMDeployment, as pure functions.

With the router enabled:

    <name>          Service  -> the router pods (the address clients already use)
    <name>-router   Deployment running `quire router --k8s-service <name>-pods`
    <name>-pods     headless Service -> the runtime pods; its EndpointSlices are the router's
                    backends (ready pods only: the runtime's /ready is their readiness probe)
    <name>-router   ServiceAccount, Role (list/watch endpointslices), RoleBinding

Router pods carry labels of their own: they must never match the runtime Deployment's
selector (`quire.dev/llmdeployment: <name>`), or it would count them as its replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from . import names, pod_security
from .gateway_spec import EXT_PROC_PORT_NAME
from .observability_spec import tracing_args, tracing_env
from .router_spec import RouterSpec
from .tls_spec import backend_tls_args, server_tls_args, tls_volume, with_https

ROUTER_LABEL = "quire.dev/router"
ROUTER_PORT = 8080
ROUTER_PORT_NAME = "http"
# precise-prefix: the router binds this for the replicas' KV-cache events (kv_events_args)
KV_EVENTS_PORT = 5557
KV_EVENTS_PORT_NAME = "kv-events"


def router_name(name: str) -> str:
    return f"{name}-router"


def headless_service_name(name: str) -> str:
    return f"{name}-pods"


def router_selector_labels(name: str) -> dict[str, str]:
    return {ROUTER_LABEL: name}


def router_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "quire",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "router",
        names.MANAGED_BY_LABEL: names.MANAGED_BY,
        **router_selector_labels(name),
    }


def _adopted(obj: dict, owner: Mapping[str, Any]) -> dict:
    kopf.adopt(obj, owner=owner)
    return obj


def router_args(name: str, spec: RouterSpec) -> list[str]:
    """The arguments after `quire` in the router container."""
    args = ["router", "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--k8s-service", headless_service_name(name), "--backend-port-name", names.PORT_NAME,
            "--routing", spec.routing, "--max-pending", str(spec.max_pending),
            "--hold-timeout", f"{spec.hold_timeout_seconds:g}"]
    if spec.ext_proc_port is not None:  # spec.gateway.inferencePool: the pool's endpoint picker
        args += ["--ext-proc-port", str(spec.ext_proc_port)]
    for objective, priority in spec.objectives:  # spec.gateway.objectives: flow control's priorities
        args += ["--objective", f"{objective}={priority}"]
    args += tracing_args(spec.observability)
    if spec.routing == "precise-prefix":
        args += ["--kv-events-bind", f"tcp://*:{KV_EVENTS_PORT}"]
    if spec.routing in ("prefix-aware", "precise-prefix"):  # it tokenizes as the replicas do
        args += ["--block-size", str(spec.block_size)]
        if spec.model_pvc_claim and spec.model_source:
            args += ["--model", f"{names.MODELS_MOUNT}/{spec.model_source}"]
        elif spec.model_source:
            args += ["--model", spec.model_source]
    return args + server_tls_args(spec.tls) + backend_tls_args(spec.tls)


def desired_router_deployment(owner: Mapping[str, Any], spec: RouterSpec, image: str) -> dict:
    name = owner["metadata"]["name"]
    container = {
        "name": "router",
        "image": spec.image or image,
        "command": ["quire"],
        "args": router_args(name, spec),
        "ports": [{"name": ROUTER_PORT_NAME, "containerPort": ROUTER_PORT, "protocol": "TCP"}, *(
            [{"name": EXT_PROC_PORT_NAME, "containerPort": spec.ext_proc_port, "protocol": "TCP"}]
            if spec.ext_proc_port is not None else []), *(
            [{"name": KV_EVENTS_PORT_NAME, "containerPort": KV_EVENTS_PORT, "protocol": "TCP"}]
            if spec.routing == "precise-prefix" else [])],
        # Always ready: with no replica it holds requests, which is its job during scale-up.
        "readinessProbe": {"httpGet": with_https({"path": "/ready", "port": ROUTER_PORT_NAME}, spec.tls),
                           "periodSeconds": 5},
        "livenessProbe": {"httpGet": with_https({"path": "/health", "port": ROUTER_PORT_NAME}, spec.tls),
                          "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": pod_security.container_security_context(),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    env = []
    if spec.backend_api_key_secret:  # only for its own reads of the replicas' /v1/models (LoRA)
        secret, key = spec.backend_api_key_secret
        env = [{"name": "QUIRE_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}]
    # the root filesystem is read-only: HOME, the caches and /tmp are emptyDirs
    container["env"] = env + pod_security.writable_env(env)
    if tracing := tracing_env(spec.observability, router_name(name)):
        container["env"] = container["env"] + tracing
    volumes, mounts = [], []
    if spec.routing in ("prefix-aware", "precise-prefix") and spec.model_pvc_claim:  # its tokenizer
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": spec.model_pvc_claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": names.MODELS_MOUNT, "readOnly": True})
    tls_volumes, tls_mounts = tls_volume(spec.tls)  # spec.tls's Secret
    writable, writable_mounts = pod_security.writable_volumes()  # a read-only root
    volumes, container["volumeMounts"] = (volumes + tls_volumes + writable,
                                          mounts + tls_mounts + writable_mounts)
    pod_spec = {
        "serviceAccountName": router_name(name),
        "containers": [container],
        "securityContext": pod_security.pod_security_context(fs_group=False),
        "enableServiceLinks": False,
        "volumes": volumes,
    }
    return _adopted({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": router_name(name), "labels": router_labels(name)},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": router_selector_labels(name)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": router_labels(name), "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT),
                    "prometheus.io/path": "/metrics",
                    **({"prometheus.io/scheme": "https"} if spec.tls.enabled else {})}},
                "spec": pod_spec,
            },
        },
    }, owner)


def desired_router_service(owner: Mapping[str, Any], spec: RouterSpec) -> dict:
    """The LLMDeployment's main Service (same name, same port) when the router is enabled:
    clients keep their address, the router stands behind it."""
    name = owner["metadata"]["name"]
    return _adopted({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": router_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector_labels(name),
            "ports": [{"name": ROUTER_PORT_NAME, "port": spec.runtime_port,
                       "targetPort": ROUTER_PORT_NAME, "protocol": "TCP"}, *(
                # the InferencePool's endpointPickerRef names this Service and port
                [{"name": EXT_PROC_PORT_NAME, "port": spec.ext_proc_port,
                  "targetPort": EXT_PROC_PORT_NAME, "protocol": "TCP"}]
                if spec.ext_proc_port is not None else []), *(
                # the replicas' KV-cache event publishers connect here (precise-prefix)
                [{"name": KV_EVENTS_PORT_NAME, "port": KV_EVENTS_PORT,
                  "targetPort": KV_EVENTS_PORT_NAME, "protocol": "TCP"}]
                if spec.routing == "precise-prefix" else [])],
        },
    }, owner)


def desired_headless_service(owner: Mapping[str, Any], spec: RouterSpec) -> dict:
    """The runtime pods, one DNS record and one EndpointSlice endpoint each (no virtual IP):
    what the router watches, and what a Gateway's endpoint picker may use instead."""
    name = owner["metadata"]["name"]
    return _adopted({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": headless_service_name(name), "labels": names.child_labels(name)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,  # loading pods are not backends
            "selector": names.serving_selector_labels(name, spec.leaders_only),
            "ports": [{"name": names.PORT_NAME, "port": spec.runtime_port,
                       "targetPort": names.PORT_NAME, "protocol": "TCP"}],
        },
    }, owner)


# The router's own identity and the one permission it needs.
ROUTER_RULES = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                 "verbs": ["list", "watch"]}]


def desired_router_service_account(owner: Mapping[str, Any]) -> dict:
    name = owner["metadata"]["name"]
    return _adopted({"apiVersion": "v1", "kind": "ServiceAccount",
                     "metadata": {"name": router_name(name), "labels": router_labels(name)}},
                    owner)


def desired_router_role(owner: Mapping[str, Any]) -> dict:
    name = owner["metadata"]["name"]
    return _adopted({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                     "metadata": {"name": router_name(name), "labels": router_labels(name)},
                     "rules": [dict(rule) for rule in ROUTER_RULES]}, owner)


def desired_router_role_binding(owner: Mapping[str, Any]) -> dict:
    name = owner["metadata"]["name"]
    return _adopted({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": router_name(name), "labels": router_labels(name)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": router_name(name)},
        "subjects": [{"kind": "ServiceAccount", "name": router_name(name),
                      "namespace": owner["metadata"]["namespace"]}],
    }, owner)


def router_children(owner: Mapping[str, Any], spec: RouterSpec, image: str) -> list[dict]:
    """Everything the router needs, in apply order (identity before the pods that use it);
    empty when it is disabled. The main Service comes from `desired_router_service` then, and
    from the runtime's own desired_service otherwise."""
    if not spec.enabled:
        return []
    return [desired_router_service_account(owner), desired_router_role(owner),
            desired_router_role_binding(owner), desired_headless_service(owner, spec),
            desired_router_deployment(owner, spec, image)]


def router_child_names(name: str) -> list[tuple[str, str]]:
    """(kind, name) of what router_children makes, in the same order: what to delete when the
    router is turned off."""
    return [("ServiceAccount", router_name(name)), ("Role", router_name(name)),
            ("RoleBinding", router_name(name)), ("Service", headless_service_name(name)),
            ("Deployment", router_name(name))]


POD_IP_ENV = "QUIRE_POD_IP"


def kv_events_args(name: str, spec: RouterSpec, runtime_port: int) -> list[str]:
    """precise-prefix: each runtime pod publishes its KV-cache events to the router's Service,
    its topic naming its own address (the router maps it to the backend)."""
    if not (spec.enabled and spec.routing == "precise-prefix"):
        return []
    import json
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://{name}:{KV_EVENTS_PORT}",
              "topic": f"kv@$({POD_IP_ENV}):{runtime_port}@{name}"}
    return ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def kv_events_env(spec: RouterSpec) -> list[dict]:
    if not (spec.enabled and spec.routing == "precise-prefix"):
        return []
    return [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
