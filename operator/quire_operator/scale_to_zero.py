"""Scale to zero and back, as pure functions.

The signals come from the router pods' /metrics (`quire_router:pending_requests`, held for
want of a ready replica; `quire_router:last_request_timestamp_seconds`); the decision only
covers the 0 <-> 1 edge. Between 1 and maxReplicas the load autoscaler decides as before.

    0 replicas, pending > 0                      -> 1         (scale from zero)
    >0 replicas, idle >= window, pending == 0    -> 0         (scale to zero)
    anything else                                -> unchanged (the autoscaler's business)

Unknown signals (no router pod answered) never scale to zero: a router we cannot read may be
holding requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

PENDING = "quire_router:pending_requests"
LAST_REQUEST = "quire_router:last_request_timestamp_seconds"
LAST_FIRST_BYTE = "quire_router:last_first_byte_timestamp_seconds"


@dataclass(frozen=True)
class RouterSignal:
    pending: int                    # requests held, summed over router pods
    last_request_time: float        # unix time, the latest over router pods
    last_first_byte_time: float = 0.0


@dataclass(frozen=True)
class ScaleToZeroDecision:
    replicas: int
    reason: str   # scale-from-zero, idle, held-requests, within-idle-window, disabled, ...
    message: str


def router_signal_from_metrics(text: str) -> RouterSignal:
    """One router pod's figures from its /metrics text."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = sample.value
    if PENDING not in values or LAST_REQUEST not in values:
        raise ValueError(f"not a quire router's metrics: {PENDING} or {LAST_REQUEST} missing")
    return RouterSignal(int(values[PENDING]), values[LAST_REQUEST], values.get(LAST_FIRST_BYTE, 0.0))


def combine_router_signals(signals: Iterable[RouterSignal | None]) -> RouterSignal | None:
    """All router pods together; None when any is unknown (it may hold requests we can't see)."""
    signals = list(signals)
    if not signals or any(s is None for s in signals):
        return None
    return RouterSignal(sum(s.pending for s in signals),
                        max(s.last_request_time for s in signals),
                        max(s.last_first_byte_time for s in signals))


def decide_scale_to_zero(*, current_replicas: int, ready_replicas: int,
                         signal: RouterSignal | None, now: float, idle_window_seconds: float,
                         min_replicas: int, max_replicas: int) -> ScaleToZeroDecision:
    """The desired replica count at the 0 <-> 1 edge, and why."""
    if min_replicas > 0:
        return ScaleToZeroDecision(current_replicas, "disabled",
                                   f"minReplicas is {min_replicas}: never scaled to zero")
    if signal is None:
        return ScaleToZeroDecision(current_replicas, "router-unknown",
                                   "no router answered: keeping the replica count")
    idle = max(0.0, now - signal.last_request_time)
    if current_replicas == 0:
        if signal.pending > 0 and max_replicas >= 1:
            return ScaleToZeroDecision(1, "scale-from-zero",
                                       f"{signal.pending} request(s) held by the router")
        return ScaleToZeroDecision(0, "idle", "no replicas and no held requests")
    if signal.pending > 0:
        # Held requests while replicas exist: they are starting; never take them away now.
        return ScaleToZeroDecision(current_replicas, "held-requests",
                                   f"{signal.pending} request(s) held while "
                                   f"{ready_replicas}/{current_replicas} replicas are ready")
    if idle >= idle_window_seconds:
        return ScaleToZeroDecision(0, "idle", f"no request for {idle:.0f}s "
                                              f"(idle window {idle_window_seconds:.0f}s)")
    return ScaleToZeroDecision(current_replicas, "within-idle-window",
                               f"last request {idle:.0f}s ago (idle window "
                               f"{idle_window_seconds:.0f}s)")


@dataclass(frozen=True)
class ColdStart:
    decided_at: float                 # unix time of the 0 -> 1 decision
    first_token_at: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.decided_at


def cold_start_finished(cold: ColdStart, signal: RouterSignal | None) -> ColdStart:
    """The cold start with its end filled in once a router has seen a replica's first byte
    after the decision (the held requests' first tokens); unchanged until then."""
    if cold.first_token_at is not None or signal is None:
        return cold
    if signal.last_first_byte_time >= cold.decided_at:
        return ColdStart(cold.decided_at, signal.last_first_byte_time)
    return cold


def cold_start_status(cold: ColdStart) -> dict:
    """What to put in status (e.g. status.scaleToZero.lastColdStart) and an Event's message."""
    out = {"decidedAt": cold.decided_at}
    if cold.seconds is not None:
        out.update(firstTokenAt=cold.first_token_at, seconds=round(cold.seconds, 3),
                   message=f"cold start: {cold.seconds:.1f}s from the scale-up decision to the "
                           "first token")
    return out
