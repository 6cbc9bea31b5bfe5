"""The LLMDeployment's status, computed from what is true: its workload (a Deployment, or a
LeaderWorkerSet of multi-node replicas, whose counts are groups) and its spec's validity."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
# Why a generation is not applied: the operator refused the spec, or the API server refused a
# child made from it (a 4xx that retrying cannot fix). Either holds until the spec changes.
INVALID_SPEC = "InvalidSpec"
REJECTED = "Rejected"
BLOCKING_REASONS = (INVALID_SPEC, REJECTED)


@dataclass(frozen=True)
class Blocked:
    reason: str  # one of BLOCKING_REASONS
    message: str


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _condition(kind: str, ok: bool, reason: str, message: str) -> dict:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}


def conditions(deployment: Mapping[str, Any] | None, blocked: Blocked | None,
               kind: str = "Deployment") -> list[dict]:
    """Ready, Progressing and Degraded, without transition times (merge_conditions adds them).
    `kind`: the workload the spec asks for, named when it does not exist."""
    if deployment is None:
        if blocked is None:
            ready = _condition(READY, False, f"No{kind}", f"the {kind} does not exist")
        else:  # nothing serves, and this is why
            ready = _condition(READY, False, blocked.reason, blocked.message)
        progressing = _condition(PROGRESSING, blocked is None, "Creating" if blocked is None else "Blocked",
                                 f"creating the {kind}" if blocked is None else "waiting for a spec that applies")
        stalled = None
    else:
        ready, progressing, stalled = _rollout(deployment)
    if blocked is not None:
        degraded = _condition(DEGRADED, True, blocked.reason, blocked.message)
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
    seen = _observed(deployment)
    stalled = next((c.get("message", "") for c in st.get("conditions") or []
                    if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"), None)

    if want == 0:
        ready_c = _condition(READY, False, "ScaledToZero", "0 replicas requested")
    elif seen and ready >= want:
        ready_c = _condition(READY, True, "AllReplicasReady", f"{ready}/{want} replicas ready")
    else:
        ready_c = _condition(READY, False, "ReplicasNotReady", f"{ready}/{want} replicas ready")

    # A LeaderWorkerSet says so while it replaces groups for a new template.
    updating = any(c.get("type") == "UpdateInProgress" and c.get("status") == "True"
                   for c in st.get("conditions") or [])
    if stalled is not None:
        progressing = _condition(PROGRESSING, False, "ProgressDeadlineExceeded", stalled)
    elif seen and not updating and updated >= want and total == want and ready >= want:
        progressing = _condition(PROGRESSING, False, "RolloutComplete", f"{want} replicas up to date and ready")
    else:
        progressing = _condition(PROGRESSING, True, "RollingOut",
                                 f"{updated}/{want} updated, {ready}/{want} ready, {total} pods")
    return ready_c, progressing, stalled


def _observed(workload: Mapping[str, Any]) -> bool:
    """Whether the workload's status describes its latest spec."""
    st = workload.get("status") or {}
    if workload.get("kind") == "LeaderWorkerSet" and "observedGeneration" not in st:
        # The LWS controller of v0.7 reports no observedGeneration: its counts are the latest it
        # computed, and UpdateInProgress (below) says while a template change rolls out.
        return bool(st)
    return (st.get("observedGeneration") or 0) >= (workload.get("metadata", {}).get("generation") or 0)


def blocked_of(status: Mapping[str, Any] | None) -> Blocked | None:
    """Why the current spec is not applied, as reported; it holds until the spec changes."""
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == DEGRADED and c.get("status") == "True" and c.get("reason") in BLOCKING_REASONS:
            return Blocked(c["reason"], c.get("message", ""))
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


def is_good(condition: Mapping[str, Any]) -> bool:
    """Ready=True, Progressing (either way) and Degraded=False are good news."""
    if condition["type"] == DEGRADED:
        return condition["status"] != "True"
    if condition["type"] == READY:
        return condition["status"] == "True"
    return True


def flipped(old: list[dict] | None, new: list[dict]) -> list[dict]:
    """The conditions whose status changed (Progressing's reason counts too: a rollout ended).
    With no earlier conditions, only Ready=True is news (pods may be ready at the first write)."""
    before = {c.get("type"): c for c in old or []}

    def changed(c: dict) -> bool:
        if c["type"] not in before:
            return c["type"] == READY and c["status"] == "True"
        was = before[c["type"]]
        return was.get("status") != c["status"] or (c["type"] == PROGRESSING and was.get("reason") != c["reason"])

    return [c for c in new if changed(c)]
