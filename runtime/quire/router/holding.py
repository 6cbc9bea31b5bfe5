"""Holding requests while no replica is ready: what makes scale-from-zero invisible to
clients, apart from the wait.

At most `max_pending` requests wait, each at most `hold_timeout` seconds; beyond either the
router answers 503 with Retry-After. The pending count is a metric: the operator scales
0 -> 1 when it is above zero.
"""

from __future__ import annotations

import time

from quire.router.backends import BackendSet
from quire.router.metrics import RouterMetrics


class HoldRejected(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "queue_full" or "hold_timeout"


class Holding:
    def __init__(self, backends: BackendSet, metrics: RouterMetrics, max_pending: int,
                 hold_timeout: float) -> None:
        if max_pending < 0 or hold_timeout < 0:
            raise ValueError("max_pending and hold_timeout must be >= 0")
        self.backends = backends
        self.metrics = metrics
        self.max_pending = max_pending
        self.hold_timeout = hold_timeout
        self.pending = 0

    async def until_backend(self) -> None:
        """Returns at once while a replica is known; else holds the request until one is, or
        raises HoldRejected."""
        if len(self.backends):
            return
        if self.pending >= self.max_pending:
            raise HoldRejected("queue_full", f"no replica is ready and {self.pending} requests "
                                             "are already waiting for one; retry later")
        self.pending += 1
        self.metrics.pending.set(self.pending)
        started = time.monotonic()
        try:
            found = await self.backends.wait_for_backends(self.hold_timeout)
        finally:
            self.pending -= 1
            self.metrics.pending.set(self.pending)
        self.metrics.hold_seconds.observe(time.monotonic() - started)
        if not found:
            raise HoldRejected("hold_timeout", f"no replica became ready within "
                                               f"{self.hold_timeout:g}s; retry later")
