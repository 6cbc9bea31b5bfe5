"""One scale-to-zero poll: read the router pods, decide the 0 <-> 1 edge, scale, record, announce.

The decision is scale_to_zero.decide_scale_to_zero's; this module does its I/O. Replicas change
through /scale, as the load autoscaler's do. Status keeps, under `scaleToZero`:

    reason, message, desiredReplicas, lastScaleTime   the last decision (written when it changes)
    coldStart: {decidedAt, firstTokenAt, seconds}     the last 0 -> 1 scale-up and, once a
                                                      router saw a replica's first byte, its length
    coldStartSeconds                                  the same length, flat (kubectl get -o jsonpath)
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

from . import status
from .kube import Kube
from .router_children import ROUTER_PORT
from .scale_to_zero import (
    ColdStart,
    RouterSignal,
    ScaleToZeroDecision,
    cold_start_finished,
    cold_start_status,
    combine_router_signals,
    decide_scale_to_zero,
    router_signal_from_metrics,
)
from .scaling import PodRef
from .scrape import MAX_PARALLEL_SCRAPES, fetch
from .spec import LLMSpec
from .status_writer import update_status

log = logging.getLogger(__name__)

# While no replica runs, a held request waits for the next poll: poll this often then.
POLL_SECONDS_AT_ZERO = 2.0


@dataclass(frozen=True)
class ZeroPoll:
    current: int                   # replicas before the poll
    decision: ScaleToZeroDecision

    @property
    def scaled(self) -> bool:
        return self.decision.replicas != self.current


def router_signal(router_pods: Iterable[PodRef], tls: ssl.SSLContext | None = None) -> RouterSignal | None:
    """All ready router pods' figures together; None if there is none, or one did not answer.
    `tls`: the router pods speak HTTPS (spec.tls)."""
    ready = [p for p in router_pods if p.ready and p.ip]

    def signal(pod: PodRef) -> RouterSignal | None:
        text = fetch(pod.ip, pod.port or ROUTER_PORT, tls=tls)
        try:
            return None if text is None else router_signal_from_metrics(text)
        except ValueError as e:
            log.debug("unusable metrics from router pod %s: %s", pod.name, e)
            return None

    if not ready:
        return None
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_SCRAPES, len(ready))) as pool:
        return combine_router_signals(pool.map(signal, ready))


def poll_zero(kube: Kube, namespace: str, name: str, spec: LLMSpec, router_pods: Iterable[PodRef],
              ready_replicas: int, now: float, announce: Callable[[str, str], None],
              tls: ssl.SSLContext | None = None) -> ZeroPoll:
    current = kube.get_scale(namespace, name).get("spec", {}).get("replicas", 0)
    signal = router_signal(router_pods, tls)
    assert spec.autoscaling.max_replicas is not None  # parse_spec: required with autoscaling on
    decision = decide_scale_to_zero(current_replicas=current, ready_replicas=ready_replicas, signal=signal,
                                    now=now, idle_window_seconds=spec.scale_to_zero.idle_window_seconds,
                                    min_replicas=spec.autoscaling.min_replicas,
                                    max_replicas=spec.autoscaling.max_replicas)
    result = ZeroPoll(current, decision)
    if result.scaled:
        kube.set_replicas(namespace, name, decision.replicas)
        log.info("%s/%s: scaled %d → %d (%s): %s", namespace, name, current, decision.replicas,
                 decision.reason, decision.message)
        what = "ScaledFromZero" if decision.replicas > current else "ScaledToZero"
        announce(what, f"{current} → {decision.replicas} replicas: {decision.message}")
    finished = _record(kube, namespace, name, result, signal, now)
    if finished is not None:
        log.info("%s/%s: %s", namespace, name, cold_start_status(finished)["message"])
        announce("ColdStart", cold_start_status(finished)["message"])
    return result


def _record(kube: Kube, namespace: str, name: str, result: ZeroPoll, signal: RouterSignal | None,
            now: float) -> ColdStart | None:
    """Writes the decision (and the cold start) to status; returns a cold start that just ended."""
    ended: list[ColdStart] = []

    def change(obj: dict) -> dict | None:
        old = (obj.get("status") or {}).get("scaleToZero") or {}
        decision = result.decision
        fields: dict = {"reason": decision.reason, "message": decision.message,
                        "desiredReplicas": decision.replicas}
        if not result.scaled and old.get("reason") == decision.reason:
            del fields["message"]  # e.g. "last request 12s ago": not worth a write every poll
        if result.scaled:
            fields["lastScaleTime"] = status.now_iso()
        if result.scaled and decision.replicas > result.current:
            # A new cold start: the last one's figures go (a merge patch would keep them).
            fields["coldStart"] = {"firstTokenAt": None, "seconds": None, "message": None,
                                   **cold_start_status(ColdStart(now)), "decidedAtTime": _iso(now)}
        elif (started := old.get("coldStart")) and "seconds" not in started:
            cold = cold_start_finished(ColdStart(float(started["decidedAt"])), signal)
            if cold.seconds is not None:
                ended.append(cold)
                fields["coldStart"] = {**cold_start_status(cold), "decidedAtTime": started.get("decidedAtTime")}
                fields["coldStartSeconds"] = fields["coldStart"]["seconds"]
        return {"scaleToZero": fields}  # update_status writes only what is new

    update_status(kube, namespace, name, change)
    return ended[0] if ended else None


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
