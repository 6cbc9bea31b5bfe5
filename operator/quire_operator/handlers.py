"""The kopf handlers: thin wiring from Kubernetes events to reconcile.py, scaling.py and housekeeping.py.

Three ways in, all ending in the same idempotent reconcile:
- the LLMDeployment itself changes (create, update, resume after a restart);
- one of its children changes or disappears (drift: watched by label, server-side);
- the housekeeping loop's periodic resync.
The housekeeping loop also runs the autoscaler and the adapter sync (spec.adapters), each from
kopf's indexes of LLMDeployments and pods.
No handler here needs a finalizer, so deleting an LLMDeployment never waits for the operator.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import logging
import time
from typing import Any

import kopf
import kubernetes

from . import names, quiet_indexers
from .adapter_spec import runtime_lora
from .adapter_sync import sync_adapters
from .defaults import default_image
from .housekeeping import Housekeeping, Key, Polled
from .kube import ApiError, kube, load_config
from .network_policy import policy_settings
from .pod_tls import TLSTrustError, client_context
from .reconcile import Announce, reconcile, repair
from .router_children import ROUTER_LABEL, ROUTER_PORT_NAME
from .scaling import PodRef, poll
from .spec import SpecError, parse_spec
from .zero_poll import POLL_SECONDS_AT_ZERO, poll_zero

log = logging.getLogger(__name__)

# How often the housekeeping loop looks for due work; each object polls at its own pollIntervalSeconds.
TICK_SECONDS = 1.0
# Every LLMDeployment is re-applied this often even when no watch event said anything changed.
RESYNC_SECONDS = 300.0
# A failed API call is retried after this long rather than kopf's default minute.
RETRY_DELAY_SECONDS = 10

LLMD = (names.GROUP, names.VERSION, names.PLURAL)
OURS = {names.MANAGED_BY_LABEL: names.MANAGED_BY}
OURS_SELECTOR = f"{names.MANAGED_BY_LABEL}={names.MANAGED_BY}"
# What the operator watches besides LLMDeployments: only what it made, filtered by the API server.
CHILD_RESOURCES = [("apps", "v1", "deployments"), ("", "v1", "services"),
                   ("policy", "v1", "poddisruptionbudgets"),
                   # spec.router's identity (its Deployment and Services are above)
                   ("", "v1", "serviceaccounts"), ("rbac.authorization.k8s.io", "v1", "roles"),
                   ("rbac.authorization.k8s.io", "v1", "rolebindings"),
                   ("networking.k8s.io", "v1", "networkpolicies"),  # the chart's networkPolicy
                   # multi-node replicas. Watched like the Deployment, for drift and for the status;
                   # where the LWS CRD is missing kopf logs that it cannot serve the kind and goes
                   # on (discovery happens once, at start: install LWS before the operator, or
                   # restart it), and the periodic resync still repairs the object.
                   ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")]
PODS = ("", "v1", "pods")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # The structural schema would prune kopf's status fields: keep its state in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=names.KOPF_PREFIX)
    # No handler needs a finalizer; naming the one older versions added lets kopf remove it.
    settings.persistence.finalizer = names.LEGACY_FINALIZER
    # No watching of namespaces and CRDs: the namespaces are given, the CRD comes before the
    # operator (Helm installs crds/ first), and RBAC then needs nothing cluster-scoped.
    settings.scanning.disabled = True
    # Watch only our own children and pods, not every Deployment and Pod in the cluster.
    for resource in [*CHILD_RESOURCES, PODS]:
        settings.watching.label_selectors[resource] = OURS_SELECTOR
    # Failures become Events: kopf's own reports of a handler that failed or will retry are
    # posted (Warning and above); our handlers post their state changes explicitly.
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    quiet_indexers.install()
    load_config()
    kube.use(kubernetes.client.ApiClient())
    log.info("quire-operator started; serving image by default: %s", default_image())
    policies = policy_settings()  # checked already by __main__ (a bad one stops the start there)
    if policies is not None:
        log.info("NetworkPolicies on: serving pods accept the router, the operator (namespace %s) "
                 "and %d allowed client peer(s)", policies.operator_namespace, len(policies.allowed_clients))


def _announcer(body: Any) -> Announce:
    # kopf.event, not kopf.info/warn: those obey posting.level, which is for kopf's own log lines.
    target = _event_target(body)
    return lambda type_, reason, message: kopf.event(target, type=type_, reason=reason, message=message[:1024])


def _event_target(body: Any) -> dict:
    meta = body.get("metadata", {})
    return {"apiVersion": body.get("apiVersion", names.API_VERSION), "kind": body.get("kind", names.KIND),
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid") if k in meta}}


@kopf.on.resume(*LLMD)
@kopf.on.create(*LLMD)
@kopf.on.update(*LLMD)
def reconcile_llmdeployment(body: kopf.Body, **_: Any) -> None:
    try:
        reconcile(kube, body, default_image(), _announcer(body))
    except ApiError as e:  # not a rejection (reconcile reports those): a server or network hiccup
        raise kopf.TemporaryError(f"API call failed, will retry: {e}", delay=RETRY_DELAY_SECONDS)


def _parent(body: kopf.Body) -> str | None:
    """The LLMDeployment that controls this child, if any."""
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == names.KIND and ref.get("apiVersion", "").startswith(names.GROUP + "/") \
                and ref.get("controller"):
            return ref.get("name")
    return None


@kopf.on.event(*CHILD_RESOURCES[0], labels=OURS)
@kopf.on.event(*CHILD_RESOURCES[1], labels=OURS)
@kopf.on.event(*CHILD_RESOURCES[2], labels=OURS)
@kopf.on.event(*CHILD_RESOURCES[3], labels=OURS)
@kopf.on.event(*CHILD_RESOURCES[4], labels=OURS)
@kopf.on.event(*CHILD_RESOURCES[5], labels=OURS)
@kopf.on.event(*CHILD_RESOURCES[6], labels=OURS)
@kopf.on.event(*CHILD_RESOURCES[7], labels=OURS)
def child_changed(type: str | None, body: kopf.Body, namespace: str, **_: Any) -> None:
    """A child changed (its status, or someone edited or deleted it): put the spec back if needed.
    Also how the Deployment's (or LeaderWorkerSet's) rollout reaches the LLMDeployment's status."""
    parent = _parent(body)
    if parent is None or type is None:
        return  # type None: the initial listing at startup, when on.resume re-applies every spec anyway
    why = f"{body.get('kind', 'child')} {body.get('metadata', {}).get('name')} {(type or 'listed').lower()}"
    try:
        repair(kube, namespace, parent, default_image(), _announcer, why)
    except ApiError as e:
        log.warning("%s/%s: could not re-apply after %s, the next change or resync retries: %s",
                    namespace, parent, why, e)


@kopf.index(*PODS, labels=OURS)
def pods_by_llmdeployment(namespace: str, name: str, labels: kopf.Labels, meta: kopf.Meta,
                          spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict:
    """(namespace, LLMDeployment) → its serving pods' IPs and readiness, kept current by the watch.
    A multi-node replica serves from its leader: its workers are neither scraped nor called."""
    parent = labels.get(names.SELECTOR_LABEL)
    if not parent or meta.get("deletionTimestamp"):
        return {}
    if labels.get(names.LWS_WORKER_INDEX_LABEL, names.LEADER_INDEX) != names.LEADER_INDEX:
        return {}
    return {(namespace, parent): PodRef(name=name, ip=status.get("podIP"), ready=_ready(status),
                                        runtime_lora=runtime_lora(spec))}


@kopf.index(*PODS, labels=OURS)
def router_pods_by_llmdeployment(namespace: str, name: str, labels: kopf.Labels, meta: kopf.Meta,
                                 spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict:
    """(namespace, LLMDeployment) → its router pods' IPs and readiness (spec.router)."""
    parent = labels.get(ROUTER_LABEL)
    if not parent or meta.get("deletionTimestamp"):
        return {}
    return {(namespace, parent): PodRef(name=name, ip=status.get("podIP"), ready=_ready(status),
                                        port=_http_port(spec))}


def _http_port(spec: kopf.Spec) -> int | None:
    for container in spec.get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == ROUTER_PORT_NAME:
                return port.get("containerPort")
    return None


def _ready(status: kopf.Status) -> bool:
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


@kopf.index(*LLMD)
def llmdeployments(namespace: str, name: str, body: kopf.Body, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> dict:
    """(namespace, name) → what the housekeeping loop needs: whom to tell, and how often to poll."""
    # kopf.event() finds kopf's Event queue through context variables that only an object's
    # handlers have; the housekeeping loop runs its jobs in a copy of this context.
    if "context" not in memo.setdefault("handler_context", {}):
        memo["handler_context"]["context"] = contextvars.copy_context()
    try:
        parsed = parse_spec(spec)
        # A KEDA-scaled object is KEDA's alone: no poll, so no /scale write from here.
        poll_seconds = parsed.autoscaling.poll_interval_seconds if parsed.autoscaling.builtin else None
        adapter_seconds = parsed.lora.sync_interval_seconds if parsed.lora.enabled else None
        adapters = parsed.adapters
    except SpecError:
        poll_seconds = adapter_seconds = None  # reconcile reports it; scaling waits for a valid spec
        adapters = ()
    return {(namespace, name): {"target": _event_target(body), "spec": copy.deepcopy(dict(spec)),
                                "poll_seconds": poll_seconds, "adapter_seconds": adapter_seconds,
                                "adapters": adapters}}


def _autoscale(pods_index: kopf.Index, router_index: kopf.Index, key: Key, entry: dict, history: Any) -> Any:
    namespace, name = key
    parsed = parse_spec(entry["spec"])
    target = entry["target"]

    def announce(reason: str, message: str) -> None:
        kopf.event(target, type="Normal", reason=reason, message=message)

    def warn(reason: str, message: str) -> None:
        kopf.event(target, type="Warning", reason=reason, message=message[:1024])

    pods = list(pods_index.get(key, []))
    try:
        tls = client_context(kube, namespace, parsed.tls)  # spec.tls: the pods speak HTTPS
        if parsed.scale_to_zero.enabled:
            # The 0 <-> 1 edge first; the load autoscaler only while replicas run and it did not scale.
            zero = poll_zero(kube, namespace, name, parsed, list(router_index.get(key, [])),
                             sum(p.ready for p in pods), time.time(), announce, tls)
            if zero.scaled or zero.current == 0:
                faster = POLL_SECONDS_AT_ZERO if zero.decision.replicas == 0 else None
                return Polled(history, faster)
        return poll(kube, namespace, name, parsed.autoscaling, parsed.port, pods,
                    history, time.time(), announce, warn, tls).history
    except (ApiError, TLSTrustError) as e:
        log.warning("%s/%s: autoscaler poll failed, the next poll retries: %s", namespace, name, e)
        return history


def _resync(key: Key) -> None:
    namespace, name = key
    try:
        repair(kube, namespace, name, default_image(), _announcer, "periodic resync", retry_rejected=True)
    except ApiError as e:
        log.warning("%s/%s: resync failed, the next one retries: %s", namespace, name, e)


def _sync_adapters(pods_index: kopf.Index, key: Key, entry: dict, announced: Any) -> Any:
    namespace, name = key
    target = entry["target"]

    def announce(type_: str, reason: str, message: str) -> None:
        kopf.event(target, type=type_, reason=reason, message=message[:1024])

    try:
        return sync_adapters(kube, namespace, name, parse_spec(entry["spec"]), list(pods_index.get(key, [])),
                             announced, announce)
    except ApiError as e:
        log.warning("%s/%s: adapter sync failed, the next one retries: %s", namespace, name, e)
        return announced


def _entries(index: kopf.Index, pods_index: kopf.Index) -> list[tuple[Key, dict]]:
    entries = []
    for key, store in index.items():
        for entry in store:
            if entry.get("adapter_seconds") is not None:
                # A sync comes at the next tick when the adapter list or the set of ready replicas
                # changes: a new replica gets every adapter as soon as it is ready.
                ready = tuple(sorted((p.name, p.ip) for p in pods_index.get(key, [])
                                     if p.ready and p.ip and p.runtime_lora))
                entry = {**entry, "adapter_trigger": (entry["adapters"], ready)}
            entries.append((key, entry))
    return entries


@kopf.on.startup()
async def start_housekeeping(memo: kopf.Memo, llmdeployments: kopf.Index, pods_by_llmdeployment: kopf.Index,
                             router_pods_by_llmdeployment: kopf.Index, **_: Any) -> None:
    holder = memo["handler_context"] = {}  # filled by the first index call (shared: memos are shallow copies)
    keeper = Housekeeping(poll=lambda key, entry, history: _autoscale(pods_by_llmdeployment, router_pods_by_llmdeployment,
                                                                 key, entry, history),
                          resync=_resync, resync_seconds=float(memo.get("resync_seconds") or RESYNC_SECONDS),
                          tick_seconds=TICK_SECONDS, context=lambda: holder.get("context"),
                          sync_adapters=lambda key, entry, announced: _sync_adapters(pods_by_llmdeployment, key,
                                                                                    entry, announced))
    memo["housekeeping"] = asyncio.create_task(keeper.run(lambda: _entries(llmdeployments, pods_by_llmdeployment)),
                                               name="housekeeping")


@kopf.on.cleanup()
async def stop_housekeeping(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("housekeeping")
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
