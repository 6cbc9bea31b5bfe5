"""One autoscaler poll: scrape the ready pods, decide, scale through /scale, record, announce."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from . import autoscaler, status
from .autoscaler import Decision, PodSample, Policy, Recommendation
from .kube import Kube
from .scrape import scrape_all
from .spec import AutoscalingSpec
from .status_writer import update_status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PodRef:
    """What the pod index keeps of each serving pod."""
    name: str
    ip: str | None
    ready: bool
    port: int | None = None  # router pods: the port of their `http` container port
    # runtime pods: started with --allow-runtime-lora (pods of a rollout that turned LoRA on are not)
    runtime_lora: bool = False


def policy_of(spec: AutoscalingSpec) -> Policy:
    assert spec.max_replicas is not None  # parse_spec requires it when autoscaling is on
    return Policy(
        # Scaling to zero is scale_to_zero's decision (idle time), never the load's.
        min_replicas=max(1, spec.min_replicas),
        max_replicas=spec.max_replicas,
        targets={autoscaler.QUEUE_DEPTH: spec.target_queue_depth,
                 autoscaler.KV_CACHE: spec.target_kv_cache_utilization},
        tolerance=spec.tolerance,
        scale_up_window=spec.scale_up_stabilization_seconds,
        scale_down_window=spec.scale_down_stabilization_seconds,
        max_scale_up_step=spec.max_scale_up_step,
    )


def sample_pods(pods: Iterable[PodRef], port: int, tls: ssl.SSLContext | None = None) -> list[PodSample]:
    pods = list(pods)
    scraped = scrape_all([p.ip for p in pods if p.ready and p.ip], port, tls)
    return [PodSample(ready=p.ready and bool(p.ip), metrics=scraped.get(p.ip) if p.ready and p.ip else None,
                      name=p.name) for p in pods]


def poll(kube: Kube, namespace: str, name: str, spec: AutoscalingSpec, port: int, pods: Iterable[PodRef],
         history: Sequence[Recommendation] | None, now: float,
         announce: Callable[[str, str], None], announce_warning: Callable[[str, str], None],
         tls: ssl.SSLContext | None = None) -> Decision:
    """Returns the decision; its history is what the next poll needs. `tls`: the pods speak HTTPS."""
    # The replica count from /scale, not from the watched body, which may lag our own last change.
    current = kube.get_scale(namespace, name).get("spec", {}).get("replicas", 0)
    decision = autoscaler.decide(current, sample_pods(pods, port, tls), policy_of(spec), history, now)
    if decision.changes(current):
        kube.set_replicas(namespace, name, decision.replicas)
        log.info("%s/%s: scaled %d → %d (%s, signal %s): %s", namespace, name, current, decision.replicas,
                 decision.reason, decision.signal, decision.message)
        announce(decision.reason, f"{decision.message} (signal: {decision.signal or 'replica limits'})")
    else:
        log.debug("%s/%s: no scaling (%s): %s", namespace, name, decision.reason, decision.message)
    if _record(kube, namespace, name, decision, current) and decision.dropped:
        # Only when the pods start sending unusable samples, not on every poll while they do.
        log.warning("%s/%s: ignoring unusable metric samples: %s", namespace, name, ", ".join(decision.dropped))
        announce_warning("UnusableMetrics", f"ignored {len(decision.dropped)} unusable metric sample(s), "
                                            f"scaling on the others: {', '.join(decision.dropped)}")
    return decision


def _record(kube: Kube, namespace: str, name: str, decision: Decision, current: int) -> bool:
    """Writes the decision to status; returns whether unusable samples are newly being dropped."""
    newly_dropping = [False]

    def change(obj: dict) -> dict:
        old = (obj.get("status") or {}).get("autoscaler") or {}
        newly_dropping[0] = bool(decision.dropped) and not old.get("droppedSamples")
        fields = {
            "desiredReplicas": decision.replicas,
            "reason": decision.reason,
            "message": decision.message,
            "signal": decision.signal,
            "observedQueueDepth": _rounded(decision.observed.get(autoscaler.QUEUE_DEPTH)),
            "observedKVCacheUtilization": _rounded(decision.observed.get(autoscaler.KV_CACHE)),
            # NaN, ±Inf or negative samples left out of this decision (and the pods they came from).
            "droppedSamples": len(decision.dropped),
        }
        if decision.changes(current):
            fields["lastScaleTime"] = status.now_iso()
        # Nothing new to say (e.g. idle or steady) means nothing to write.
        fields = {k: v for k, v in fields.items() if not (v is None and k not in old)}
        return {"autoscaler": fields}

    update_status(kube, namespace, name, change)
    return newly_dropping[0]


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
