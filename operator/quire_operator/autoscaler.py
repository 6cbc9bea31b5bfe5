"""The replica count an LLMDeployment should have: a pure function, in the manner of the HPA.

For each signal, ratio = the per-replica average of a metric / its target, and the signal asks
for ceil(current × ratio) replicas, or for no change within the tolerance. The largest request
wins; stabilization windows smooth it (scale up only to the lowest recommendation of the up
window, down only to the highest of the down window), a step limit caps a scale-up, and the
result stays within [minReplicas, maxReplicas].

Pods that are not ready, or whose metrics are missing, count conservatively, as the HPA counts
them: as idle when the others ask to scale up, as exactly on target when they ask to scale down.
No data, no decision.

A sample that is not a finite, non-negative number (NaN, ±Inf, a negative gauge from a broken
exporter) is dropped before anything else, and that pod counts as missing for that signal: one
bad pod never stops the decision for the others. Decision.dropped lists what was dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

QUEUE_DEPTH = "queueDepth"
KV_CACHE = "kvCacheUtilization"
# The runtime's gauges behind each signal.
METRIC_OF = {QUEUE_DEPTH: "quire:num_requests_waiting", KV_CACHE: "quire:kv_cache_usage_perc"}
_EPSILON = 1e-9


@dataclass(frozen=True)
class PodSample:
    """One pod as the autoscaler saw it; metrics is None when its scrape failed."""
    ready: bool
    metrics: Mapping[str, float] | None = None
    name: str = ""


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    targets: Mapping[str, float]  # signal name → per-replica target
    tolerance: float = 0.1
    scale_up_window: float = 0.0
    scale_down_window: float = 300.0
    max_scale_up_step: int = 4


@dataclass(frozen=True)
class Recommendation:
    time: float
    replicas: int


@dataclass(frozen=True)
class Decision:
    replicas: int  # what to scale to; equal to current when nothing changes
    reason: str
    message: str
    signal: str | None = None  # the signal that drove the recommendation
    recommendation: int | None = None  # before stabilization, limits and clamping
    observed: Mapping[str, float] = field(default_factory=dict)  # per-replica averages
    history: tuple[Recommendation, ...] = ()
    dropped: tuple[str, ...] = ()  # "pod metric=value" for each sample that was not usable

    def changes(self, current: int) -> bool:
        return self.replicas != current


@dataclass(frozen=True)
class _Proposal:
    signal: str
    replicas: int
    ratio: float
    average: float


def decide(current: int, pods: Sequence[PodSample], policy: Policy,
           history: Sequence[Recommendation] | None, now: float) -> Decision:
    """The next replica count. history=None means unknown (e.g. after an operator restart):
    it is taken as if `current` had been recommended just now, which holds off a scale-down
    for a full window rather than trusting no memory."""
    known = tuple(history) if history is not None else (Recommendation(now, current),)
    pods, dropped = drop_bad_samples(pods)
    if current < policy.min_replicas:
        return Decision(policy.min_replicas, "BelowMinReplicas",
                        f"{current} replicas is below minReplicas {policy.min_replicas}", history=known,
                        dropped=dropped)
    if current > policy.max_replicas:
        return Decision(policy.max_replicas, "AboveMaxReplicas",
                        f"{current} replicas is above maxReplicas {policy.max_replicas}", history=known,
                        dropped=dropped)

    proposals = [p for name, target in policy.targets.items()
                 if (p := _propose(name, target, current, pods, policy.tolerance)) is not None]
    observed = {p.signal: p.average for p in proposals}
    if not proposals:
        return Decision(current, "NoMetrics", "no ready pod reported usable metrics; keeping the replica count",
                        observed=observed, history=known, dropped=dropped)
    best = max(proposals, key=lambda p: (p.replicas, p.ratio))

    window = max(policy.scale_up_window, policy.scale_down_window)
    kept = tuple(r for r in known if now - r.time <= window) + (Recommendation(now, best.replicas),)
    up_floor = min(r.replicas for r in kept if now - r.time <= policy.scale_up_window)
    down_ceiling = max(r.replicas for r in kept if now - r.time <= policy.scale_down_window)
    replicas = current
    if replicas < up_floor:
        replicas = up_floor
    if replicas > down_ceiling:
        replicas = down_ceiling
    stabilized = replicas
    if replicas > current:
        replicas = min(replicas, current + policy.max_scale_up_step)
    limited = replicas
    replicas = max(policy.min_replicas, min(policy.max_replicas, replicas))

    why = _explain(best, policy.targets[best.signal])
    if replicas > current:
        reason = "ScaledUp"
        if replicas < best.replicas:
            why += f"; limited by {_limit(best.replicas, stabilized, limited, replicas)}"
    elif replicas < current:
        reason = "ScaledDown"
    elif best.replicas == current:
        reason = "WithinTolerance" if abs(best.ratio - 1) <= policy.tolerance or best.ratio == 1 else "Steady"
    elif best.replicas > current:
        reason = "ScaleUpStabilized" if stabilized == current else "AtMaxReplicas"
    else:
        reason = "ScaleDownStabilized" if stabilized == current else "AtMinReplicas"
    message = f"{why}; {current} → {replicas} replicas"
    if dropped:
        message += f"; ignored {len(dropped)} unusable sample(s): {', '.join(dropped)}"
    return Decision(replicas, reason, message, best.signal, best.replicas, observed, kept, dropped)


def usable(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def drop_bad_samples(pods: Sequence[PodSample]) -> tuple[list[PodSample], tuple[str, ...]]:
    """The pods without their unusable samples of the signals' metrics, and what was dropped."""
    cleaned, dropped = [], []
    for i, pod in enumerate(pods):
        if pod.metrics is None:
            cleaned.append(pod)
            continue
        bad = {m for m in METRIC_OF.values() if m in pod.metrics and not usable(pod.metrics[m])}
        dropped += [f"{pod.name or f'pod {i}'} {m}={pod.metrics[m]}" for m in sorted(bad)]
        cleaned.append(PodSample(pod.ready, {k: v for k, v in pod.metrics.items() if k not in bad}, pod.name)
                       if bad else pod)
    return cleaned, tuple(dropped)


def _propose(signal: str, target: float, current: int, pods: Sequence[PodSample],
             tolerance: float) -> _Proposal | None:
    metric = METRIC_OF[signal]
    values = [p.metrics[metric] for p in pods if p.ready and p.metrics is not None and metric in p.metrics]
    if not values:
        return None
    average = sum(values) / len(values)
    ratio = average / target
    missing = max(current - len(values), 0)
    if missing:
        # Unready pods, failed scrapes and pods not started yet: idle if scaling up, on target
        # if scaling down. If that flips the direction, the honest answer is "no change".
        fill = 0.0 if ratio > 1 else target
        adjusted = (sum(values) + fill * missing) / (target * (len(values) + missing))
        if (adjusted > 1) != (ratio > 1) or abs(adjusted - 1) <= tolerance:
            return _Proposal(signal, current, adjusted, average)
        ratio = adjusted
    if abs(ratio - 1) <= tolerance:
        return _Proposal(signal, current, ratio, average)
    return _Proposal(signal, math.ceil(current * ratio - _EPSILON), ratio, average)


def _explain(p: _Proposal, target: float) -> str:
    label = {QUEUE_DEPTH: "queue depth", KV_CACHE: "KV-cache utilization"}[p.signal]
    return f"{label} {p.average:.3g} per replica against a target of {target:g} asks for {p.replicas}"


def _limit(wanted: int, stabilized: int, limited: int, final: int) -> str:
    """Which bound stopped a scale-up short: the tightest one is named."""
    if final < limited:
        return "maxReplicas"
    if limited < stabilized:
        return "maxScaleUpStep"
    return "the scale-up stabilization window"
