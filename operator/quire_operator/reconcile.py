"""Make an LLMDeployment's children match its spec, and say so in its status.

Pure functions (spec.py, children.py) compute what should exist; this module reads what does,
writes only the difference, and reports. Safe to run any number of times.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from . import names, status
from .children import desired_deployment, desired_pdb, desired_service, endpoint, owner_of, with_hash
from .kube import Kube
from .spec import LLMSpec, SpecError, parse_spec
from .status_writer import update_status

log = logging.getLogger(__name__)

# kind → (group, version, plural)
KINDS = {
    "Deployment": ("apps", "v1", "deployments"),
    "Service": ("", "v1", "services"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
}
_KEEP = object()  # "leave the reported spec error as it is"


def apply(kube: Kube, namespace: str, desired: dict) -> tuple[str, dict]:
    """Create or patch one child; returns (what was done, the live object)."""
    desired = with_hash(desired)
    kind, name = desired["kind"], desired["metadata"]["name"]
    group, version, plural = KINDS[kind]
    live = kube.get(group, version, plural, namespace, name)
    if live is None:
        return "created", kube.create(group, version, plural, namespace, desired)
    want_hash = desired["metadata"]["annotations"][names.HASH_ANNOTATION]
    have_hash = (live.get("metadata", {}).get("annotations") or {}).get(names.HASH_ANNOTATION)
    want_replicas = desired.get("spec", {}).get("replicas")
    if have_hash == want_hash and live.get("spec", {}).get("replicas") == want_replicas:
        return "unchanged", live
    return "patched", kube.patch(group, version, plural, namespace, name, desired)


def reconcile(kube: Kube, body: Mapping[str, Any], default_image: str,
              warn: Callable[[str, str], None]) -> None:
    """Apply one generation of the spec; an invalid spec is reported and changes nothing."""
    meta = body["metadata"]
    namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation")
    try:
        spec = parse_spec(body.get("spec"))
    except SpecError as e:
        log.warning("%s/%s: invalid spec, children left as they are: %s", namespace, name, e)
        warn("InvalidSpec", str(e))
        refresh_status(kube, namespace, name, spec_error=str(e))
        return

    owner = owner_of(body)
    deployment = _apply_logged(kube, namespace, desired_deployment(owner, spec, default_image), spec)
    _apply_logged(kube, namespace, desired_service(owner, spec), spec)
    pdb = desired_pdb(owner, spec)
    if pdb is not None:
        _apply_logged(kube, namespace, pdb, spec)
    elif kube.get("policy", "v1", "poddisruptionbudgets", namespace, name) is not None:
        kube.delete("policy", "v1", "poddisruptionbudgets", namespace, name)
        log.info("%s/%s: deleted the PodDisruptionBudget: spec.podDisruptionBudget is off", namespace, name)
    log.debug("%s/%s: Deployment at generation %s", namespace, name,
              deployment.get("metadata", {}).get("generation"))
    refresh_status(kube, namespace, name, spec_error=None, spec=spec, generation=generation)


def _apply_logged(kube: Kube, namespace: str, desired: dict, spec: LLMSpec) -> dict:
    action, live = apply(kube, namespace, desired)
    if action != "unchanged":
        why = "it did not exist" if action == "created" else "the spec changed"
        log.info("%s/%s: %s the %s (replicas=%s) because %s", namespace, desired["metadata"]["name"], action,
                 desired["kind"], desired.get("spec", {}).get("replicas", "-"), why)
    return live


def refresh_status(kube: Kube, namespace: str, name: str, *, spec_error: Any = _KEEP,
                   spec: LLMSpec | None = None, generation: int | None = None) -> bool:
    """Recompute the status from the live Deployment. With a generation, mark it as applied."""

    def change(obj: dict) -> dict:
        old = obj.get("status") or {}
        error = status.spec_error_of(old) if spec_error is _KEEP else spec_error
        # Read the Deployment afresh under the status lock: a watch event may be older than it.
        live = kube.get("apps", "v1", "deployments", namespace, name)
        fields: dict[str, Any] = {
            "conditions": status.merge_conditions(old.get("conditions"), status.conditions(live, error),
                                                  status.now_iso()),
            **status.replica_counts(live),
            "selector": names.selector_string(name),
        }
        if spec is not None:
            fields["endpoint"] = endpoint(obj, spec)
        if generation is not None and error is None:
            fields["observedGeneration"] = generation
        return fields

    return update_status(kube, namespace, name, change)
