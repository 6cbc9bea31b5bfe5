"""The pod that serves one replica: `quire serve` with flags from the spec, probes, GPUs."""

from __future__ import annotations

import math

from . import names, pod_security
from .adapter_spec import ADAPTERS_MOUNT, adapter_claims, claim_volume_name, lora_flags
from .gateway_children import gateway_runtime_args
from .kv_cache_spec import kv_offload_args, kv_offload_env, kv_offload_volumes
from .observability_spec import tracing_args, tracing_env
from .router_children import kv_events_args, kv_events_env
from .spec import LLMSpec, RuntimeSpec
from .tls_spec import server_tls_args, tls_volume, with_https

# How often the startup probe asks /health while the model loads.
STARTUP_PERIOD_SECONDS = 10
# Time between SIGTERM's drain deadline and SIGKILL: the server needs a moment to exit.
GRACE_MARGIN_SECONDS = 15
# /dev/shm for tensor-parallel workers (NCCL's shared-memory transport, torch's shared tensors):
# 1Gi per worker, at most 8Gi. A ceiling, not a reservation: the volume takes memory only as it
# fills, and what it holds counts against the pod's memory limit (spec.resources.memory).
SHM_GI_PER_WORKER = 1
SHM_GI_MAX = 8


def model_argument(spec: LLMSpec) -> str | None:
    """MODEL for `quire serve`, as the pod sees it; None serves the runtime's default model."""
    source = spec.model.source
    if spec.model.pvc_claim:
        return f"{names.MODELS_MOUNT}/{source}"
    return source


def server_args(spec: LLMSpec, name: str = "") -> list[str]:
    """The arguments after `quire`: the runtime's CLI, vLLM-style flag names (`name`: the
    LLMDeployment's, which the KV tiers' and events' Services take)."""
    args = ["serve"]
    model = model_argument(spec)
    if model is not None:
        args.append(model)
    args += ["--host", "0.0.0.0", "--port", str(spec.port)]
    if spec.model.served_name:
        args += ["--served-model-name", spec.model.served_name]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    # 1 is the runtime's default: single-worker pods keep their args. A multi-node replica's pods
    # get it with the rest of their group's flags (lws_children.group_args).
    if spec.parallelism.tensor > 1 and not spec.parallelism.multi_node:
        args += ["--tensor-parallel-size", str(spec.parallelism.tensor)]
    args += runtime_flags(spec.runtime)
    # LoRA's switch and limits only: the adapters themselves are loaded through the API, so
    # editing spec.adapters never changes (and never rolls) the pods.
    args += lora_flags(spec.lora)
    args += gateway_runtime_args(spec)
    args += server_tls_args(spec.tls)
    args += tracing_args(spec.observability)
    args += kv_offload_args(name, spec.kv_offload)
    args += kv_events_args(name, spec.router, spec.port)
    args += list(spec.runtime.extra_args)
    return args


def runtime_flags(rt: RuntimeSpec) -> list[str]:
    valued = [
        ("--dtype", rt.dtype),
        ("--max-model-len", rt.max_model_len),
        ("--block-size", rt.block_size),
        ("--max-num-seqs", rt.max_num_seqs),
        ("--max-num-batched-tokens", rt.max_num_batched_tokens),
        ("--kv-cache-dtype", rt.kv_cache_dtype),
        ("--kv-cache-memory", rt.kv_cache_memory),
        ("--kv-cache-memory-fraction", rt.kv_cache_memory_fraction),
        ("--max-queue-len", rt.max_queue_len),
        ("--shutdown-timeout", rt.shutdown_timeout_seconds),
    ]
    flags = []
    for flag, value in valued:
        if value is not None:
            flags += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if rt.enable_prefix_caching is not None:
        flags.append("--enable-prefix-caching" if rt.enable_prefix_caching else "--no-enable-prefix-caching")
    if rt.log_requests:
        flags.append("--log-requests")
    return flags


def _env(spec: LLMSpec) -> list[dict]:
    env = [dict(item) for item in spec.env]
    if spec.model.cache_claim:
        env.append({"name": "HF_HOME", "value": f"{names.CACHE_MOUNT}/huggingface"})
    if spec.runtime.api_key_secret:
        secret, key = spec.runtime.api_key_secret
        env.append({"name": "QUIRE_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    return env + pod_security.writable_env(env)  # the root filesystem is read-only


def _resources(spec: LLMSpec) -> dict:
    requests, limits = {}, {}
    if spec.resources.cpu is not None:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = spec.resources.memory
    if spec.resources.gpus:
        limits["nvidia.com/gpu"] = spec.resources.gpus  # extended resources: limits only
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def shm_size_limit(spec: LLMSpec) -> str | None:
    """The /dev/shm sizeLimit: spec.parallelism.shmSize, else 1Gi per tensor-parallel worker.

    None for a single worker without shmSize: that pod's volume stays as it was before
    parallelism existed, so an operator upgrade rolls no running pods."""
    if spec.parallelism.shm_size is not None:
        return spec.parallelism.shm_size
    if spec.parallelism.tensor == 1:
        return None
    return f"{min(spec.parallelism.tensor * SHM_GI_PER_WORKER, SHM_GI_MAX)}Gi"


def _volumes(spec: LLMSpec, serving: bool) -> tuple[list[dict], list[dict]]:
    # torch's shared-memory tensors outgrow the container runtime's 64 MiB /dev/shm.
    shm = {"medium": "Memory"}
    if (limit := shm_size_limit(spec)) is not None:
        shm["sizeLimit"] = limit
    volumes = [{"name": "dshm", "emptyDir": shm}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.model.pvc_claim:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": spec.model.pvc_claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": names.MODELS_MOUNT, "readOnly": True})
    if spec.model.cache_claim:
        volumes.append({"name": "cache", "persistentVolumeClaim": {"claimName": spec.model.cache_claim}})
        mounts.append({"name": "cache", "mountPath": names.CACHE_MOUNT})
    for claim in adapter_claims(spec.adapters):  # pvc:// adapter sources, read-only
        volume = claim_volume_name(claim)
        volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": volume, "mountPath": f"{ADAPTERS_MOUNT}/{claim}", "readOnly": True})
    # spec.tls's Secret, for the API (a headless worker serves none)
    tls_volumes, tls_mounts = tls_volume(spec.tls) if serving else ([], [])
    kv_volumes, kv_mounts = kv_offload_volumes(spec.kv_offload)  # the disk tier
    writable, writable_mounts = pod_security.writable_volumes()  # the root filesystem is read-only
    return (volumes + tls_volumes + kv_volumes + writable,
            mounts + tls_mounts + kv_mounts + writable_mounts)


def _probes(spec: LLMSpec) -> dict:
    def http_get(path: str) -> dict:
        return with_https({"path": path, "port": names.PORT_NAME}, spec.tls)

    return {
        # /health answers while the engine loop lives; loading a model may take many minutes.
        "startupProbe": {
            "httpGet": http_get("/health"),
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": math.ceil(spec.runtime.startup_timeout_seconds / STARTUP_PERIOD_SECONDS),
        },
        # /ready is 200 only once the model serves: the Service sends traffic to ready pods only.
        "readinessProbe": {"httpGet": http_get("/ready"), "periodSeconds": 5, "timeoutSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": http_get("/health"), "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": 6},
    }


def group_key_env(spec: LLMSpec) -> list[dict]:
    """A multi-node group's step-channel key (the runtime's QUIRE_DISTRIBUTED_KEY), from the
    Secret spec.parallelism.keySecret names; nothing for single-node pods."""
    if not spec.parallelism.multi_node or spec.parallelism.key_secret is None:
        return []
    secret, key = spec.parallelism.key_secret
    return [{"name": "QUIRE_DISTRIBUTED_KEY",
             "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}]


def pod_template(name: str, spec: LLMSpec, default_image: str, *, args: list[str] | None = None,
                 serving: bool = True, extra_ports: tuple[dict, ...] = ()) -> dict:
    """The pod of one replica (`args`: the arguments after `quire`, server_args by default).

    serving=False is a headless pipeline-stage worker of a multi-node replica (lws_children.py):
    it serves no API, so it gets no serving port, no HTTP probes, no scrape annotations and
    nothing only the API uses (TLS, tracing, KV events); everything else (image, resources,
    volumes, security, scheduling) is the serving pod's, so the group's pods match."""
    volumes, mounts = _volumes(spec, serving)
    container = {
        "name": names.CONTAINER_NAME,
        "image": spec.image or default_image,
        "command": ["quire"],
        "args": server_args(spec, name) if args is None else args,
    }
    if serving:
        container["ports"] = [{"name": names.PORT_NAME, "containerPort": spec.port, "protocol": "TCP"},
                              *extra_ports]
        container["env"] = (_env(spec) + tracing_env(spec.observability, name, spec.env)
                            + kv_offload_env(spec.kv_offload) + kv_events_env(spec.router)
                            + group_key_env(spec))
    else:
        container["env"] = _env(spec) + group_key_env(spec)
    container.update({
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "securityContext": pod_security.container_security_context(),
        # A worker has no probe of its own: LWS recreates the whole group when any pod restarts,
        # and a worker that hangs stalls the leader's steps, which its liveness probe catches.
        **(_probes(spec) if serving else {}),
    })
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.port),
        "prometheus.io/path": "/metrics",
        **({"prometheus.io/scheme": "https"} if spec.tls.enabled else {}),
        **spec.pod_annotations,
    } if serving else dict(spec.pod_annotations)
    pod_spec = {
        "containers": [container],
        "volumes": volumes,
        # The server drains in-flight requests for --shutdown-timeout after SIGTERM.
        "terminationGracePeriodSeconds": spec.runtime.shutdown_timeout_seconds + GRACE_MARGIN_SECONDS,
        "securityContext": pod_security.pod_security_context(),
        "enableServiceLinks": False,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    labels = names.child_labels(name) if serving else {**names.child_labels(name),
                                                        "app.kubernetes.io/component": "worker"}
    metadata: dict = {"labels": labels}
    if annotations:
        metadata["annotations"] = annotations
    return {"metadata": metadata, "spec": pod_spec}
