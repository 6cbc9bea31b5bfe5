"""Flow control: when every replica is saturated, requests wait in the router, most important
first and fairly across tenants, instead of piling into replicas' queues.

    flow = FlowControl(backends, metrics, Saturation(), max_wait=60, max_queued=1024)
    ticket = await flow.admit(priority=0, tenant="team-a")  # or raises Shed / WaitExpired
    ... pick a replica, open the request on it (its in-flight count goes up) ...
    flow.dispatched(ticket)                                  # the next waiter may be judged

The Gateway API Inference Extension's model (its saturation detector and flow control):

- a replica is *saturated* when its queue holds `queue_depth` requests (5) or its KV cache is
  `kv_usage` (0.8) full, read from the metrics the load scraper reads; requests the router sent
  since that scrape count as queued there, so a burst does not overrun a fresh scrape;
- while every replica is saturated (or others already wait), a request waits. Priorities are
  GIE's: higher is more important; a request of priority < 0 is *sheddable*: it is answered
  429 with Retry-After instead of waiting; others wait, most important first, and within one
  priority tenants take turns (one FIFO per tenant, served round-robin), so a tenant that
  floods the router only lengthens its own queue;
- a request that waited `max_wait` seconds gets a 503 that says so; beyond `max_queued`
  waiters, a 503 at once.

Waiters are let go one at a time, each once the previous one has been sent (`dispatched`),
re-judging saturation in between; a scrape or a finished request wakes the pump (`notify`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field

from quire.router.backends import Backend, BackendSet

logger = logging.getLogger(__name__)

# GIE's saturation detector defaults
DEFAULT_QUEUE_DEPTH = 5
DEFAULT_KV_USAGE = 0.8
DISPATCH_GRACE = 2.0  # s a released waiter has to open its request before the next goes
RELEASES_KEPT = 64  # the last releases, in order, shown on /state (fairness made visible)


class Shed(Exception):
    """A sheddable request (priority < 0) while every replica is saturated: 429."""


class WaitExpired(Exception):
    """No replica had room within the wait bound, or too many wait already: 503."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # flow_timeout or flow_queue_full


@dataclass(frozen=True)
class Saturation:
    queue_depth: float = DEFAULT_QUEUE_DEPTH
    kv_usage: float = DEFAULT_KV_USAGE

    def __post_init__(self) -> None:
        if self.queue_depth <= 0 or not 0 < self.kv_usage <= 1:
            raise ValueError("the saturation queue depth must be > 0 and the KV usage "
                             f"threshold in (0, 1]; got {self.queue_depth}, {self.kv_usage}")

    def saturated(self, b: Backend) -> bool:
        if b.scraped_at is None:
            return False  # not read yet: nothing says it is full
        queued = b.waiting + max(0, b.in_flight - b.in_flight_at_scrape)
        return queued >= self.queue_depth or b.kv_usage >= self.kv_usage


@dataclass
class Ticket:
    priority: int
    tenant: str
    arrived: float = field(default_factory=time.monotonic)
    released: asyncio.Future | None = None
    sent: asyncio.Event = field(default_factory=asyncio.Event)


class FlowControl:
    def __init__(self, backends: BackendSet, metrics, saturation: Saturation | None = None,
                 max_wait: float = 60.0, max_queued: int = 1024, enabled: bool = True) -> None:
        if max_wait < 0 or max_queued < 0:
            raise ValueError("the flow-control wait bound and queue size must be >= 0")
        self.backends = backends
        self.metrics = metrics
        self.saturation = saturation or Saturation()
        self.max_wait = max_wait
        self.max_queued = max_queued
        self.enabled = enabled
        # priority -> tenant -> FIFO of tickets; tenants in turn order (served one moves last)
        self._queues: dict[int, collections.OrderedDict[str, collections.deque]] = {}
        self._queued = 0
        self._changed: asyncio.Event | None = None
        self._pump: asyncio.Task | None = None
        self._releases: collections.deque[dict] = collections.deque(maxlen=RELEASES_KEPT)

    # --- reads ---------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return self._queued

    def all_saturated(self, candidates: list[Backend] | None = None) -> bool:
        """True when there are live replicas and none has room (no replica: the hold's
        business; none live: a request fails fast at the proxy, instead of waiting on figures
        the dead ones last reported)."""
        backends = self.backends.all() if candidates is None else candidates
        live = [b for b in backends if not b.down]
        return bool(live) and all(self.saturation.saturated(b) for b in live)

    def recent_releases(self) -> list[dict]:
        """The last waiters let go, oldest first: priority, tenant and seconds waited. The
        router's own order (a replica may see two back-to-back sends swapped)."""
        return list(self._releases)

    # --- a request -----------------------------------------------------------------------
    async def admit(self, priority: int, tenant: str) -> Ticket | None:
        """Returns once the request may go to a replica (a Ticket to pass to `dispatched`,
        or None when it did not wait). Raises Shed or WaitExpired."""
        if not self.enabled or (not self._queued and not self.all_saturated()):
            return None
        if priority < 0:
            self.metrics.shed.labels(reason="saturated").inc()
            raise Shed("every replica is saturated and this request is sheddable (priority "
                       f"{priority} < 0); retry later")
        if self._queued >= self.max_queued:
            raise WaitExpired("flow_queue_full", f"every replica is saturated and "
                              f"{self._queued} requests already wait; retry later")
        ticket = Ticket(priority, tenant, released=asyncio.get_running_loop().create_future())
        self._push(ticket)
        self._wake()
        try:
            await asyncio.wait_for(asyncio.shield(ticket.released), self.max_wait)
        except asyncio.TimeoutError:
            self._remove(ticket)
            raise WaitExpired("flow_timeout", f"every replica stayed saturated for "
                              f"{self.max_wait:g}s while this request waited; retry later") from None
        except BaseException:
            self._remove(ticket)
            ticket.sent.set()  # (cancelled: the client left) the pump must not wait on it
            raise
        finally:
            self.metrics.flow_wait_seconds.observe(time.monotonic() - ticket.arrived)
        return ticket

    def dispatched(self, ticket: Ticket | None) -> None:
        """The released request is open on a replica (or failed): judge the next one."""
        if ticket is not None:
            ticket.sent.set()

    def notify(self) -> None:
        """Load changed (a scrape, a finished request): waiters may have room now."""
        if self._changed is not None:
            self._changed.set()

    # --- the queue -----------------------------------------------------------------------
    def _push(self, ticket: Ticket) -> None:
        tenants = self._queues.setdefault(ticket.priority, collections.OrderedDict())
        tenants.setdefault(ticket.tenant, collections.deque()).append(ticket)
        self._queued += 1
        self._gauge(ticket.priority)

    def _remove(self, ticket: Ticket) -> None:
        tenants = self._queues.get(ticket.priority, {})
        fifo = tenants.get(ticket.tenant)
        if fifo is not None and ticket in fifo:
            fifo.remove(ticket)
            self._queued -= 1
            if not fifo:
                del tenants[ticket.tenant]
            if not tenants:
                self._queues.pop(ticket.priority, None)
            self._gauge(ticket.priority)

    def _pop(self) -> Ticket | None:
        """The head of the most important priority's next tenant in turn."""
        if not self._queues:
            return None
        priority = max(self._queues)
        tenants = self._queues[priority]
        tenant, fifo = next(iter(tenants.items()))
        ticket = fifo.popleft()
        if fifo:
            tenants.move_to_end(tenant)  # its next request waits for the others' turns
        else:
            del tenants[tenant]
        if not tenants:
            del self._queues[priority]
        self._queued -= 1
        self._gauge(priority)
        return ticket

    def _gauge(self, priority: int) -> None:
        n = sum(len(f) for f in self._queues.get(priority, {}).values())
        self.metrics.flow_queued.labels(priority=str(priority)).set(n)

    # --- the pump ------------------------------------------------------------------------
    def _wake(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        self._changed.set()
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self._queued:
            self._changed.clear()
            if self.all_saturated():
                with contextlib.suppress(asyncio.TimeoutError):
                    # scrapes and finished requests set it; the timeout re-checks regardless
                    await asyncio.wait_for(self._changed.wait(), 0.5)
                continue
            ticket = self._pop()
            if ticket is None or ticket.released.done():
                continue
            ticket.released.set_result(None)
            self._releases.append({"priority": ticket.priority, "tenant": ticket.tenant,
                                   "waited": round(time.monotonic() - ticket.arrived, 3)})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ticket.sent.wait(), DISPATCH_GRACE)
