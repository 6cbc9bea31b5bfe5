"""Make an LLMDeployment's children match its spec, and say so in its status.

Pure functions (spec.py, children.py) compute what should exist; this module reads what does,
writes only the difference, and reports. Safe to run any number of times, from any trigger: a
spec change, a change to a child (drift), or the periodic resync.

What cannot succeed is not retried: a spec the operator refuses, or a child the API server
refuses with a 4xx that is not about timing (409, 429), becomes Degraded=True with the reason,
one Warning Event, and no further writes until the spec changes.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from . import names, status
from .children import (
    desired_deployment,
    desired_pdb,
    desired_service,
    endpoint,
    owner_of,
    with_hash,
)
from .drift import drift_of, patch_for
from .gateway_children import gateway_child_names, gateway_children
from .keda_children import desired_scaled_object, keda_child_names
from .kube import ApiError, Kube, resource_path
from .kv_cache_spec import desired_valkey_children, valkey_child_names, valkey_name
from .lws_children import CONTROL_PORT, MASTER_PORT, desired_leaderworkerset, wants_leaderworkerset
from .network_policy import desired_network_policies, policy_names, policy_settings
from .pod_tls import with_trust_key
from .router_children import (
    KV_EVENTS_PORT,
    desired_router_service,
    headless_service_name,
    router_child_names,
    router_children,
    router_name,
)
from .spec import LLMSpec, SpecError, check_name, parse_spec
from .status import Blocked
from .status_writer import update_status

log = logging.getLogger(__name__)

# announce(type, reason, message): an Event on the LLMDeployment ("Normal" or "Warning").
Announce = Callable[[str, str, str], None]

# kind → (group, version, plural)
KINDS = {
    "Deployment": ("apps", "v1", "deployments"),
    "StatefulSet": ("apps", "v1", "statefulsets"),
    "Service": ("", "v1", "services"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "ServiceAccount": ("", "v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io", "v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    # Kinds of other projects' CRDs, written only when the spec asks (spec.gateway, KEDA).
    "InferencePool": ("inference.networking.k8s.io", "v1", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io", "v1", "httproutes"),
    "InferenceObjective": ("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives"),
    "ScaledObject": ("keda.sh", "v1alpha1", "scaledobjects"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
    # spec.parallelism.pipeline > 1: the multi-node replicas, in place of the Deployment.
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
}
# Which install each of those kinds needs: its creation answering 404 means the CRD is missing.
INSTALLED_BY = {"InferencePool": "the Gateway API Inference Extension CRDs",
                "InferenceObjective": "the Gateway API Inference Extension's x-k8s.io CRDs",
                "HTTPRoute": "the Gateway API CRDs", "ScaledObject": "KEDA",
                "LeaderWorkerSet": "the LeaderWorkerSet controller (kubernetes-sigs/lws v0.7 or later)"}
# 4xx answers that say "not now" rather than "never": a race with another writer, or throttling.
TRANSIENT_CLIENT_ERRORS = (404, 408, 409, 429)
_KEEP = object()  # "leave the reported blocking problem as it is"

# One reconcile at a time per LLMDeployment: its handler, its children's watchers and the resync
# run in different worker threads.
_guard = threading.Lock()
_locks: dict[tuple[str, str], threading.RLock] = defaultdict(threading.RLock)


def _lock_for(namespace: str, name: str) -> threading.RLock:
    with _guard:
        return _locks[namespace, name]


class ChildRejected(Exception):
    """The API server refused a child for good (a 4xx other than TRANSIENT_CLIENT_ERRORS)."""

    def __init__(self, kind: str, name: str, error: ApiError, hint: str = "") -> None:
        super().__init__(f"the API server rejected the {kind} {name!r}: {error}{hint}")
        self.error = error


def is_permanent(error: ApiError) -> bool:
    return 400 <= error.status < 500 and error.status not in TRANSIENT_CLIENT_ERRORS


def apply(kube: Kube, namespace: str, desired: dict) -> tuple[str, dict]:
    """Create or patch one child; returns (what was done, the live object).

    What was done: "created", "updated" (the spec asked for something new), "restored" (someone
    changed what the operator had written) or "unchanged"."""
    desired = with_hash(desired)
    kind, name = desired["kind"], desired["metadata"]["name"]
    group, version, plural = KINDS[kind]
    try:
        live = kube.get(group, version, plural, namespace, name)
        if live is None:
            return "created", kube.create(group, version, plural, namespace, desired)
        drift = drift_of(live, desired)
        if drift is None:
            return "unchanged", live
        ours = (live.get("metadata", {}).get("annotations") or {}).get(names.HASH_ANNOTATION)
        action = "restored" if ours == desired["metadata"]["annotations"][names.HASH_ANNOTATION] else "updated"
        log.debug("%s/%s: the %s differs in %s", namespace, name, kind, drift)
        return action, kube.patch(group, version, plural, namespace, name, patch_for(live, desired))
    except ApiError as e:
        if e.status == 404 and kind in INSTALLED_BY:
            # Not a race: the kind itself is unknown. The periodic resync retries it.
            raise ChildRejected(kind, name, e, f" (is {INSTALLED_BY[kind]} installed?)") from e
        if is_permanent(e):
            raise ChildRejected(kind, name, e) from e
        raise


def reconcile(kube: Kube, body: Mapping[str, Any], default_image: str, announce: Announce, *,
              fresh: bool = False) -> None:
    """Apply the spec (the live one where it is newer than `body`, unless `fresh` says body was
    read under this lock); a spec that cannot apply is reported and changes nothing."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    with _lock_for(namespace, name):
        body = body if fresh else _newest(kube, body)
        generation = body["metadata"].get("generation")
        try:
            check_name(name)
            spec = parse_spec(body.get("spec"))
            check_child_names(name, spec)
            check_ports(spec)
        except SpecError as e:
            _block(kube, body, Blocked(status.INVALID_SPEC, str(e)), announce)
            return
        spec = _with_router_trust(kube, namespace, spec)
        try:
            deployment = _apply_children(kube, namespace, owner_of(body), spec, default_image, announce)
        except ChildRejected as e:
            _block(kube, body, Blocked(status.REJECTED, str(e)), announce)
            return
        log.debug("%s/%s: %s at generation %s", namespace, name, deployment.get("kind"),
                  deployment.get("metadata", {}).get("generation"))
        refresh_status(kube, namespace, name, blocked=None, spec=spec, generation=generation, announce=announce)


def check_child_names(name: str, spec: LLMSpec) -> None:
    """The longest names this spec's children take, each a Service name, a pod's host name or
    a label value (63 characters at most): a name that fits alone may not with its suffixes,
    and must be refused before anything is written, not halfway through."""
    longer = []
    if spec.router.enabled:
        longer += [router_name(name), headless_service_name(name)]
    if spec.kv_offload.valkey is not None:
        longer.append(valkey_name(name) + "-0")  # its StatefulSet pod
    if spec.parallelism.multi_node:  # group g's Service <name>-g, its pods <name>-g-w
        groups = max(spec.replicas, spec.autoscaling.max_replicas or 0, 1)
        longer.append(f"{name}-{groups - 1}-{spec.parallelism.pipeline - 1}")
    for child in longer:
        if len(child) > names.MAX_NAME_LENGTH:
            room = names.MAX_NAME_LENGTH - (len(child) - len(name))
            raise SpecError("metadata.name", f"{name!r} is {len(name)} characters, so this "
                            f"spec's child {child!r} would be {len(child)}, past the "
                            f"{names.MAX_NAME_LENGTH} a Service name, a pod's host name or a "
                            f"label value takes: at most {room} characters fit this spec")


def check_ports(spec: LLMSpec) -> None:
    """spec.port against the fixed ports that share an object with it (the API server refuses
    a Service or a container with one port twice; two listeners cannot bind one)."""
    taken = {}
    if spec.router.enabled and spec.router.ext_proc_port is not None:
        taken[spec.router.ext_proc_port] = ("the endpoint picker's (gRPC ext_proc, for "
                                            "spec.gateway.inferencePool) on the Service")
    if spec.router.enabled and spec.router.routing == "precise-prefix":
        taken[KV_EVENTS_PORT] = "the KV events' (routing: precise-prefix) on the Service"
    if spec.parallelism.multi_node:
        taken[MASTER_PORT] = "the group's rendezvous (torch.distributed) on the leader"
        taken[CONTROL_PORT] = "the group's control channel on the leader"
    if spec.port in taken:
        raise SpecError("spec.port", f"{spec.port} is {taken[spec.port]} too; choose another "
                        f"port (not {', '.join(map(str, sorted(taken)))})")


def _newest(kube: Kube, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The live LLMDeployment where its spec is newer than `body`'s. kopf hands a handler the
    body of the event it processes, and a child's event or the resync (which read it afresh)
    may have applied a later spec meanwhile: applying the older one would roll the pods back
    to it, then forward again on the next event, and set observedGeneration back."""
    meta = body["metadata"]
    live = kube.get_llmdeployment(meta["namespace"], meta["name"])
    if live is not None and (live["metadata"].get("generation") or 0) > (meta.get("generation") or 0):
        log.debug("%s/%s: generation %s is live; the handler's body has %s", meta["namespace"],
                  meta["name"], live["metadata"].get("generation"), meta.get("generation"))
        return live
    return body


def repair(kube: Kube, namespace: str, name: str, default_image: str, announce_for: Callable[[dict], Announce],
           why: str, *, retry_rejected: bool = False) -> None:
    """Re-apply the current spec after a child changed or on the periodic resync.

    Reads the LLMDeployment afresh: replicas are whatever the autoscaler (or `kubectl scale`, or
    HPA, through /scale) set last, never an older copy. A spec reported as invalid is left
    alone; one the API server rejected is tried again only with `retry_rejected` (the periodic
    resync: the cause may lie outside the spec, such as an admission policy)."""
    with _lock_for(namespace, name):
        owner = kube.get_llmdeployment(namespace, name)
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            return  # going away: garbage collection removes the children
        blocked = status.blocked_of(owner.get("status"))
        if blocked is not None and (blocked.reason == status.INVALID_SPEC or not retry_rejected):
            refresh_status(kube, namespace, name)  # only the rollout figures may have changed
            return
        log.debug("%s/%s: re-applying the spec (%s)", namespace, name, why)
        reconcile(kube, owner, default_image, announce_for(owner), fresh=True)


def _apply_children(kube: Kube, namespace: str, owner: dict, spec: LLMSpec, default_image: str,
                    announce: Announce) -> dict:
    name = owner["metadata"]["name"]
    image = spec.image or default_image
    _apply_network_policies(kube, namespace, owner, spec, announce)  # before any pod can start
    deployment = _apply_workload(kube, namespace, owner, spec, default_image, announce)
    router = router_children(owner, spec.router, image)
    for child in router:  # identity and the headless Service before the router pods
        _apply_announced(kube, namespace, child, announce)
    main_service = desired_router_service(owner, spec.router) if spec.router.enabled else desired_service(owner, spec)
    _apply_announced(kube, namespace, main_service, announce)
    if not router:  # turned off (or never on): nothing of the router may stay behind
        for kind, child_name in reversed(router_child_names(name)):
            _delete_child(kube, namespace, kind, child_name, announce, "spec.router is off")
    pdb = desired_pdb(owner, spec)
    if pdb is not None:
        _apply_announced(kube, namespace, pdb, announce)
    else:
        _delete_child(kube, namespace, "PodDisruptionBudget", name, announce, "spec.podDisruptionBudget is off")
    # After the router's Service, which the InferencePool names as its endpoint picker.
    gateway = gateway_children(owner, spec)
    _apply_optional(kube, namespace, gateway, gateway_child_names(name), announce,
                    "spec.gateway does not ask for it")
    if spec.gateway.inference_pool:
        _prune_objectives(kube, namespace, name, {c["metadata"]["name"] for c in gateway
                                                  if c["kind"] == "InferenceObjective"}, announce)
    # spec.kvCache.offload.remote.valkey: the shared KV tier's server, before the pods need it
    _apply_optional(kube, namespace, desired_valkey_children(owner, spec.kv_offload),
                    valkey_child_names(name), announce, "spec.kvCache.offload does not ask for a Valkey")
    scaled_object = desired_scaled_object(owner, spec)
    _apply_optional(kube, namespace, [scaled_object] if scaled_object else [], keda_child_names(name),
                    announce, "spec.autoscaling.provider is not keda")
    return deployment


def _apply_workload(kube: Kube, namespace: str, owner: dict, spec: LLMSpec, default_image: str,
                    announce: Announce) -> dict:
    """The serving pods: a Deployment, or a LeaderWorkerSet when each replica spans several
    nodes; the other kind is deleted once this one is written, so a switch never leaves two
    sets of serving pods (and a LeaderWorkerSet the cluster cannot take leaves the Deployment
    serving, with the reason in Degraded). The Services follow in the same pass."""
    name = owner["metadata"]["name"]
    if spec.parallelism.multi_node:
        workload = desired_leaderworkerset(owner, spec, default_image)
        other, why = "Deployment", "spec.parallelism.pipeline > 1 runs as a LeaderWorkerSet"
    else:
        workload = desired_deployment(owner, spec, default_image)
        other, why = "LeaderWorkerSet", "spec.parallelism.pipeline is 1: a Deployment serves"
    assert workload is not None
    live = _apply_announced(kube, namespace, workload, announce)
    _delete_child(kube, namespace, other, name, announce, why)
    return live


def _apply_optional(kube: Kube, namespace: str, wanted: list[dict], possible: list[tuple[str, str]],
                    announce: Announce, why: str) -> None:
    """Apply what the spec asks for; delete what it could ask for but does not (any more)."""
    for child in wanted:
        _apply_announced(kube, namespace, child, announce)
    have = {(child["kind"], child["metadata"]["name"]) for child in wanted}
    for kind, child_name in possible:
        if (kind, child_name) not in have:
            _delete_child(kube, namespace, kind, child_name, announce, why)


def _prune_objectives(kube: Kube, namespace: str, name: str, wanted: set[str],
                      announce: Announce) -> None:
    """InferenceObjectives this LLMDeployment wrote (its labels) that spec.gateway.objectives no
    longer lists: user-named, so found by listing, not by name."""
    group, version, plural = KINDS["InferenceObjective"]
    try:
        found = kube.request("GET", resource_path(group, version, plural, namespace),
                             query={"labelSelector": names.selector_string(name)})
    except ApiError as e:
        if e.status == 404:  # the CRD is not installed: nothing of ours can exist
            return
        raise
    for item in found.get("items") or []:
        if item["metadata"]["name"] not in wanted:
            _delete_child(kube, namespace, "InferenceObjective", item["metadata"]["name"], announce,
                          "spec.gateway.objectives no longer lists it")


def _with_router_trust(kube: Kube, namespace: str, spec: LLMSpec) -> LLMSpec:
    """With spec.tls and the router: which of the Secret's files the router verifies replicas with
    (its ca.crt, else tls.crt). The periodic resync follows a Secret that gains or loses ca.crt."""
    if not (spec.tls.enabled and spec.router.enabled):
        return spec
    tls = with_trust_key(kube, namespace, spec.tls)
    return replace(spec, tls=tls, router=replace(spec.router, tls=tls))


def _apply_network_policies(kube: Kube, namespace: str, owner: dict, spec: LLMSpec,
                            announce: Announce) -> None:
    """The chart's networkPolicy (network_policy.py): its policies, and none left over from
    before it (or spec.router) was turned off."""
    policies = desired_network_policies(owner, spec, policy_settings())
    for policy in policies:
        _apply_announced(kube, namespace, policy, announce)
    wanted = {policy["metadata"]["name"] for policy in policies}
    for policy_name in policy_names(owner["metadata"]["name"]):
        if policy_name not in wanted:
            why = "spec.router is off" if policies else "the operator's networkPolicy is off"
            _delete_child(kube, namespace, "NetworkPolicy", policy_name, announce, why)


def _delete_child(kube: Kube, namespace: str, kind: str, name: str, announce: Announce, why: str) -> None:
    """Delete a child the spec no longer asks for, if it exists (one GET when it does not)."""
    group, version, plural = KINDS[kind]
    try:
        if kube.get(group, version, plural, namespace, name) is None:
            return
        kube.delete(group, version, plural, namespace, name)
    except ApiError as e:
        if e.status == 404:
            return
        if is_permanent(e):
            raise ChildRejected(kind, name, e) from e
        raise
    log.info("%s/%s: deleted the %s %s: %s", namespace, name, kind, name, why)
    announce("Normal", "Deleted", f"{kind} {name} deleted: {why}")


_SAID = {
    "created": ("Created", "created"),
    "updated": ("Updated", "updated to the new spec"),
    "restored": ("DriftCorrected", "changed from outside the operator; restored to the spec"),
}


def _apply_announced(kube: Kube, namespace: str, desired: dict, announce: Announce) -> dict:
    action, live = apply(kube, namespace, desired)
    if action != "unchanged":
        reason, said = _SAID[action]
        kind, name = desired["kind"], desired["metadata"]["name"]
        replicas = desired.get("spec", {}).get("replicas")
        detail = f" (replicas={replicas})" if replicas is not None else ""
        log.info("%s/%s: %s %s%s", namespace, name, kind, said, detail)
        announce("Normal", reason, f"{kind} {name} {said}{detail}")
    return live


def _block(kube: Kube, body: Mapping[str, Any], blocked: Blocked, announce: Announce) -> None:
    """Report why this spec is not applied: once per new problem, not on every retry."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    if status.blocked_of(body.get("status")) != blocked:
        log.warning("%s/%s: %s; children left as they are: %s", namespace, name, blocked.reason, blocked.message)
        announce("Warning", blocked.reason, blocked.message)
    refresh_status(kube, namespace, name, blocked=blocked, announce=announce)


def refresh_status(kube: Kube, namespace: str, name: str, *, blocked: Any = _KEEP,
                   spec: LLMSpec | None = None, generation: int | None = None,
                   announce: Announce | None = None) -> bool:
    """Recompute the status from the live workload (Deployment or LeaderWorkerSet). With a
    generation, mark it as applied. With `announce`, a condition that changes its status is
    announced as an Event."""
    changed: list[dict] = []

    def change(obj: dict) -> dict:
        old = obj.get("status") or {}
        problem = status.blocked_of(old) if blocked is _KEEP else blocked
        # Read the workload afresh under the status lock: a watch event may be older than it.
        multi_node = wants_leaderworkerset(obj.get("spec"))
        kind, live = _live_workload(kube, namespace, name, multi_node)
        conditions = status.merge_conditions(old.get("conditions"), status.conditions(live, problem, kind),
                                             status.now_iso())
        changed[:] = status.flipped(old.get("conditions"), conditions)
        fields: dict[str, Any] = {
            "conditions": conditions,
            **status.replica_counts(live),
            "selector": names.selector_string(name, leaders_only=multi_node),
        }
        if spec is not None:
            fields["endpoint"] = endpoint(obj, spec)
            if not spec.lora.enabled:  # LoRA turned off: the pods roll, and the adapter sync stops
                fields.update(adapters=None, adaptersReady=None, managedAdapters=None)
        if generation is not None and problem is None:
            fields["observedGeneration"] = generation
        return fields

    wrote = update_status(kube, namespace, name, change)
    if wrote and announce is not None:
        for c in changed:
            if c["type"] != status.DEGRADED or c["reason"] not in status.BLOCKING_REASONS:  # _block said it
                announce("Normal" if status.is_good(c) else "Warning", c["reason"],
                         f"{c['type']} is {c['status']}: {c['message']}")
    return wrote


def _live_workload(kube: Kube, namespace: str, name: str, multi_node: bool) -> tuple[str, dict | None]:
    """(the kind the spec asks for, the live workload): that kind's object, else the other's
    while it still serves (a spec refused in the same edit that switched kinds)."""
    kinds = ["LeaderWorkerSet", "Deployment"] if multi_node else ["Deployment", "LeaderWorkerSet"]
    for kind in kinds:
        live = kube.get(*KINDS[kind], namespace, name)
        if live is not None:
            return kinds[0], live
    return kinds[0], None
