"""The kopf handlers: thin wiring from Kubernetes events to reconcile.py and scaling.py."""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf
import kubernetes

from . import names
from .defaults import default_image
from .kube import ApiError, kube, load_config
from .reconcile import reconcile, refresh_status
from .scaling import PodRef, poll
from .spec import SpecError, parse_spec

log = logging.getLogger(__name__)

# How often the autoscaling timer wakes; each object polls at its own pollIntervalSeconds.
TICK_SECONDS = 1.0
# A failed API call is retried after this long rather than kopf's default minute.
RETRY_DELAY_SECONDS = 10

LLMD = (names.GROUP, names.VERSION, names.PLURAL)
OURS = {names.MANAGED_BY_LABEL: names.MANAGED_BY}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # The structural schema would prune kopf's status fields: keep its state in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=names.KOPF_PREFIX)
    settings.persistence.finalizer = names.FINALIZER
    # No watching of namespaces and CRDs: the namespaces are given, the CRD comes before the
    # operator (Helm installs crds/ first), and RBAC then needs nothing cluster-scoped.
    settings.scanning.disabled = True
    # Our own Events say what happened; kopf posts only its warnings and errors.
    settings.posting.level = logging.WARNING
    load_config()
    kube.use(kubernetes.client.ApiClient())
    log.info("quire-operator started; serving image by default: %s", default_image())


def _warn(body: kopf.Body):
    return lambda reason, message: kopf.warn(body, reason=reason, message=message)


@kopf.on.resume(*LLMD)
@kopf.on.create(*LLMD)
@kopf.on.update(*LLMD)
def reconcile_llmdeployment(body: kopf.Body, **_: Any) -> None:
    try:
        reconcile(kube, body, default_image(), _warn(body))
    except ApiError as e:
        raise kopf.TemporaryError(f"API call failed, will retry: {e}", delay=RETRY_DELAY_SECONDS)


@kopf.on.event("apps", "v1", "deployments", labels=OURS)
def deployment_event(type: str | None, body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> None:
    """The Deployment's status is the LLMDeployment's; a deleted Deployment is put back."""
    parent = labels.get(names.SELECTOR_LABEL)
    if not parent or not any(ref.get("kind") == names.KIND for ref in body.get("metadata", {}).get("ownerReferences", [])):
        return
    try:
        if type == "DELETED":
            owner = kube.get_llmdeployment(namespace, parent)
            if owner is not None and not owner["metadata"].get("deletionTimestamp"):
                log.info("%s/%s: the Deployment was deleted from outside; restoring it", namespace, parent)
                reconcile(kube, owner, default_image(), _warn(owner))
            return
        refresh_status(kube, namespace, parent)
    except ApiError as e:
        log.warning("%s/%s: could not update the status from the Deployment: %s", namespace, parent, e)


@kopf.index("", "v1", "pods", labels=OURS)
def pods_by_llmdeployment(namespace: str, name: str, labels: kopf.Labels, meta: kopf.Meta,
                          status: kopf.Status, **_: Any) -> dict:
    """(namespace, LLMDeployment) → its pods' IPs and readiness, kept current by the watch."""
    parent = labels.get(names.SELECTOR_LABEL)
    if not parent or meta.get("deletionTimestamp"):
        return {}
    ready = status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return {(namespace, parent): PodRef(name=name, ip=status.get("podIP"), ready=ready)}


def _autoscaling_on(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


@kopf.timer(*LLMD, interval=TICK_SECONDS, when=_autoscaling_on)
def autoscale(body: kopf.Body, spec: kopf.Spec, name: str, namespace: str, memo: kopf.Memo,
              pods_by_llmdeployment: kopf.Index, **_: Any) -> None:
    try:
        parsed = parse_spec(spec)
    except SpecError:
        return  # reconcile reports it; scaling waits for a valid spec
    now = time.monotonic()
    if now - memo.get("last_poll", float("-inf")) < parsed.autoscaling.poll_interval_seconds:
        return
    memo["last_poll"] = now
    try:
        decision = poll(kube, namespace, name, parsed.autoscaling, parsed.port,
                        pods_by_llmdeployment.get((namespace, name), []), memo.get("history"), time.time(),
                        # kopf.event, not kopf.info: posting.level (WARNING) filters kopf.info out.
                        lambda reason, message: kopf.event(body, type="Normal", reason=reason, message=message))
    except ApiError as e:
        log.warning("%s/%s: autoscaler poll failed, next poll retries: %s", namespace, name, e)
        return
    memo["history"] = decision.history
