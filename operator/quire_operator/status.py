"""The LLMDeployment's status, computed from what is true: its Deployment and its spec's validity."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
INVALID_SPEC = "InvalidSpec"


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _condition(kind: str, ok: bool, reason: str, message: str) -> dict:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}


def conditions(deployment: Mapping[str, Any] | None, spec_error: str | None) -> list[dict]:
    """Ready, Progressing and Degraded, without transition times (merge_conditions adds them)."""
    if deployment is None:
        ready = _condition(READY, False, "NoDeployment", "the Deployment does not exist")
        progressing = _condition(PROGRESSING, spec_error is None, "Creating" if spec_error is None else "Blocked",
                                 "creating the Deployment" if spec_error is None else "waiting for a valid spec")
        stalled = None
    else:
        ready, progressing, stalled = _rollout(deployment)
    if spec_error is not None:
        degraded = _condition(DEGRADED, True, INVALID_SPEC, spec_error)
    elif stalled is not None:
        degraded = _condition(DEGRADED, True, "ProgressDeadlineExceeded", f"pods did not become ready in time: {stalled}")
    else:
        degraded = _condition(DEGRADED, False, "AsExpected", "the spec is valid and applied")
    return [ready, progressing, degraded]


def _rollout(deployment: Mapping[str, Any]) -> tuple[dict, dict, str | None]:
    want = deployment.get("spec", {}).get("replicas", 1)
    st = deployment.get("status") or {}
    ready = st.get("readyReplicas") or 0
    updated = st.get("updatedReplicas") or 0
    total = st.get("replicas") or 0
    # Until the Deployment controller has seen the latest spec, its counts describe the old one.
    seen = (st.get("observedGeneration") or 0) >= (deployment.get("metadata", {}).get("generation") or 0)
    stalled = next((c.get("message", "") for c in st.get("conditions") or []
                    if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"), None)

    if want == 0:
        ready_c = _condition(READY, False, "ScaledToZero", "0 replicas requested")
    elif seen and ready >= want:
        ready_c = _condition(READY, True, "AllReplicasReady", f"{ready}/{want} replicas ready")
    else:
        ready_c = _condition(READY, False, "ReplicasNotReady", f"{ready}/{want} replicas ready")

    if stalled is not None:
        progressing = _condition(PROGRESSING, False, "ProgressDeadlineExceeded", stalled)
    elif seen and updated >= want and total == want and ready >= want:
        progressing = _condition(PROGRESSING, False, "RolloutComplete", f"{want} replicas up to date and ready")
    else:
        progressing = _condition(PROGRESSING, True, "RollingOut",
                                 f"{updated}/{want} updated, {ready}/{want} ready, {total} pods")
    return ready_c, progressing, stalled


def spec_error_of(status: Mapping[str, Any] | None) -> str | None:
    """The invalid-spec message currently reported, if any: it holds until the spec is fixed."""
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == DEGRADED and c.get("status") == "True" and c.get("reason") == INVALID_SPEC:
            return c.get("message", "")
    return None


def merge_conditions(old: list[dict] | None, new: list[dict], now: str) -> list[dict]:
    """lastTransitionTime moves only when a condition's status flips."""
    previous = {c.get("type"): c for c in old or []}
    merged = []
    for c in new:
        before = previous.get(c["type"])
        keep = before and before.get("status") == c["status"] and before.get("lastTransitionTime")
        merged.append({**c, "lastTransitionTime": before["lastTransitionTime"] if keep else now})
    return merged


def replica_counts(deployment: Mapping[str, Any] | None) -> dict:
    st = (deployment or {}).get("status") or {}
    return {"replicas": st.get("replicas") or 0, "readyReplicas": st.get("readyReplicas") or 0}
