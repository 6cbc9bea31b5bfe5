"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection package does it.

Why a Lease of our own and not kopf peering: peering pauses operators of lower priority, and
two replicas of one Deployment have the same priority (kopf then pauses both, or, standalone,
both act); it also needs two CRDs of its own and cluster-wide RBAC for them. A Lease is the
Kubernetes way (kube-controller-manager, client-go): a namespaced object, three verbs.

The rules:
- a candidate takes the Lease when it is free, released, or not renewed for leaseDuration
  (measured on the candidate's own clock from when it last saw the Lease change, so clock
  skew between nodes does not matter);
- every write carries the resourceVersion it read, so of two candidates one wins (409 for
  the other);
- the leader renews every retry period and gives up, stopping the operator, when it could
  not renew for renewDeadline (< leaseDuration: it stops before anyone else may start);
- on a clean shutdown the leader releases the Lease, so a standby takes over at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .kube import ApiError, Kube

log = logging.getLogger(__name__)

LEASES = ("coordination.k8s.io", "v1", "leases")


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("leader election needs 0 < retry period < renew deadline < lease duration, not "
                             f"{self.retry_period} / {self.renew_deadline} / {self.lease_duration}")


def _micro_time() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, kube: Kube, settings: LeaseSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube, self.settings, self.clock = kube, settings, clock
        self._seen: tuple[Any, ...] | None = None  # the Lease's spec as last read
        self._seen_at = 0.0  # when it last changed, by our clock

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True if we hold the Lease afterwards."""
        s = self.settings
        group, version, plural = LEASES
        lease = self.kube.get(group, version, plural, s.namespace, s.name)
        now = _micro_time()
        if lease is None:
            try:
                self.kube.create(group, version, plural, s.namespace, {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": s.name, "namespace": s.namespace},
                    "spec": self._spec(now, acquired=now, transitions=0)})
                return True
            except ApiError as e:
                if e.status == 409:
                    return False  # another candidate created it first
                raise
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        seen = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        if seen != self._seen:
            self._seen, self._seen_at = seen, self.clock()
        duration = spec.get("leaseDurationSeconds") or s.lease_duration
        if holder and holder != s.identity and self.clock() - self._seen_at < duration:
            return False  # held, and renewed recently enough
        ours = holder == s.identity
        transitions = (spec.get("leaseTransitions") or 0) + (0 if ours else 1)
        try:
            self.kube.patch(group, version, plural, s.namespace, s.name, {
                # The resourceVersion makes this a compare-and-swap: 409 if anyone wrote since.
                "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": self._spec(now, acquired=spec.get("acquireTime") if ours else now, transitions=transitions)})
        except ApiError as e:
            if e.status == 409:
                return False
            raise
        if not ours:
            log.info("took the Lease %s/%s from %r", s.namespace, s.name, holder or "nobody")
        return True

    def _spec(self, now: str, *, acquired: str | None, transitions: int) -> dict:
        return {"holderIdentity": self.settings.identity, "leaseDurationSeconds": int(self.settings.lease_duration),
                "acquireTime": acquired or now, "renewTime": now, "leaseTransitions": transitions}

    def _attempt(self) -> bool:
        try:
            return self.try_acquire_or_renew()
        except Exception as e:  # an unreachable API server is a failed attempt, not a crash
            log.warning("leader election: could not reach the Lease: %s", e)
            return False

    def acquire(self, stop: threading.Event) -> bool:
        """Block until we lead (True) or `stop` is set (False)."""
        s = self.settings
        log.info("waiting to lead: Lease %s/%s, identity %s", s.namespace, s.name, s.identity)
        while not stop.is_set():
            if self._attempt():
                log.info("leading as %s", s.identity)
                return True
            stop.wait(s.retry_period)
        return False

    def keep(self, stop: threading.Event, on_lost: Callable[[], None]) -> None:
        """Renew until `stop` is set; call on_lost once if renewal fails for renewDeadline."""
        s = self.settings
        renewed = self.clock()
        while not stop.wait(s.retry_period):
            if self._attempt():
                renewed = self.clock()
            elif self.clock() - renewed >= s.renew_deadline:
                log.error("lost the Lease %s/%s (not renewed for %.1f s): stopping", s.namespace, s.name,
                          self.clock() - renewed)
                on_lost()
                return

    def release(self) -> None:
        """Hand the Lease back if we hold it, so that a standby need not wait for it to expire."""
        s = self.settings
        group, version, plural = LEASES
        try:
            lease = self.kube.get(group, version, plural, s.namespace, s.name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != s.identity:
                return
            self.kube.patch(group, version, plural, s.namespace, s.name, {
                "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": _micro_time()}})
            log.info("released the Lease %s/%s", s.namespace, s.name)
        except Exception as e:  # it expires by itself anyway
            log.warning("could not release the Lease: %s", e)
