"""A multi-node replica (`spec.parallelism.pipeline` > 1) as a LeaderWorkerSet, a pure function.

    <name>   LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, kubernetes-sigs/lws v0.7+):
             spec.replicas groups of `pipeline` pods, one pipeline stage per pod, each pod
             holding `tensor` GPUs. Pod 0 of a group, the leader, runs `quire serve` with the
             API; the others are headless workers that join its process group.

Each group gets its own headless Service, named after its leader pod (<name>-<group>:
networkConfig.subdomainPolicy UniquePerReplica), which LWS_LEADER_ADDRESS resolves through.
The default (Shared) has LWS create one headless Service named <name>, the client Service's
own name: LWS skips a Service that exists, so the leader's address never resolved, and the
operator would have taken over one LWS made first (its clients then sent to loading leaders).

The LWS controller gives every pod of a group LWS_LEADER_ADDRESS (the leader's DNS name),
LWS_GROUP_SIZE and LWS_WORKER_INDEX (0 for the leader), and labels it with that index
(names.LWS_WORKER_INDEX_LABEL): the Services, the router and the autoscaler select leaders only.
Kubernetes expands `$(VAR)` in args from the container's env, so the flags name them directly.

A group is one replica: spec.replicas (and /scale, the autoscaler, KEDA) count groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from . import names
from .children import initial_replicas
from .pod_template import model_argument, pod_template, runtime_flags, server_args
from .spec import LLMSpec

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_API = f"{LWS_GROUP}/v1"
KIND = "LeaderWorkerSet"
# torch.distributed's rendezvous on the leader, and the runtime's control channel next to it.
MASTER_PORT = 29500
CONTROL_PORT = MASTER_PORT + 1
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
WORKER_INDEX = "$(LWS_WORKER_INDEX)"
# Any pod of a group that restarts restarts the whole group: a stage that comes back alone
# cannot rejoin a process group whose other members still wait in a collective.
RESTART_POLICY = "RecreateGroupOnPodRestart"
# Workers start as soon as the leader exists, as vLLM's LWS examples run it. LeaderReady would
# deadlock: the leader is ready (/ready) only once the model is loaded, which needs every stage.
STARTUP_POLICY = "LeaderCreated"
SUBDOMAIN_POLICY = "UniquePerReplica"  # (the module's docstring says why)


def wants_leaderworkerset(raw_spec: Mapping[str, Any] | None) -> bool:
    """Whether a raw spec asks for a LeaderWorkerSet, without parsing (or failing on) the rest:
    the status of a spec the operator refuses still reads the workload that runs."""
    pipeline = ((raw_spec or {}).get("parallelism") or {}).get("pipeline", 1)
    return isinstance(pipeline, int) and not isinstance(pipeline, bool) and pipeline > 1


def group_args(spec: LLMSpec, rank: str) -> list[str]:
    """The flags that make a pod stage `rank` of its group."""
    pipeline = str(spec.parallelism.pipeline)
    return ["--tensor-parallel-size", str(spec.parallelism.tensor), "--pipeline-parallel-size", pipeline,
            "--nnodes", pipeline, "--node-rank", rank, "--master-addr", LEADER_ADDRESS,
            "--master-port", str(MASTER_PORT)]


def leader_args(spec: LLMSpec, name: str) -> list[str]:
    """The single-node pod's arguments (the API, its TLS, tracing...) plus stage 0's flags."""
    return server_args(spec, name) + group_args(spec, "0")


def worker_args(spec: LLMSpec) -> list[str]:
    """What defines the model and the engine, as the leader has it, and no API (--headless)."""
    args = ["serve"]
    model = model_argument(spec)
    if model is not None:
        args.append(model)
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    args += runtime_flags(spec.runtime) + list(spec.runtime.extra_args)
    return args + group_args(spec, WORKER_INDEX) + ["--headless"]


def desired_leaderworkerset(owner: Mapping[str, Any], spec: LLMSpec, default_image: str) -> dict | None:
    """None for a single-node spec: a plain Deployment serves it (children.desired_deployment)."""
    if not spec.parallelism.multi_node:
        return None
    name = owner["metadata"]["name"]
    leader = pod_template(name, spec, default_image, args=leader_args(spec, name), extra_ports=(
        {"name": "rendezvous", "containerPort": MASTER_PORT, "protocol": "TCP"},
        {"name": "control", "containerPort": CONTROL_PORT, "protocol": "TCP"}))
    worker = pod_template(name, spec, default_image, args=worker_args(spec), serving=False)
    lws = {
        "apiVersion": LWS_API,
        "kind": KIND,
        "metadata": {"name": name, "labels": names.child_labels(name)},
        "spec": {
            "replicas": initial_replicas(spec),
            "startupPolicy": STARTUP_POLICY,
            "networkConfig": {"subdomainPolicy": SUBDOMAIN_POLICY},
            # As the Deployment: never below the serving capacity during a rollout, one new
            # group at a time.
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}},
            "leaderWorkerTemplate": {
                "size": spec.parallelism.pipeline,
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }
    kopf.adopt(lws, owner=owner)
    return lws
