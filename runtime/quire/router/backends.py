"""The replicas the router may send requests to, and what it knows of each one's load.

Discovery (a static list, the admin API, or an EndpointSlice watch) replaces the set; the
load scraper fills in each replica's queue and KV usage; the proxy counts its own in-flight
requests. Held requests wait on `wait_for_backends` until the set is non-empty.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# A replica that refused a connection or answered 503 (full, loading, draining) is passed over
# this long unless no other is left, so that a dead or full replica does not cost every
# request a failed attempt first.
FAILURE_COOLDOWN = 5.0

# A full KV cache means the next request preempts someone: count it like this many queued
# requests, so that between two equally busy replicas the one with free blocks wins.
KV_USAGE_WEIGHT = 4.0


@dataclass
class Backend:
    url: str                      # http(s)://host:port, no trailing slash
    in_flight: int = 0            # requests this router has open on it now
    waiting: float = 0.0          # scraped quire:num_requests_waiting
    running: float = 0.0          # scraped quire:num_requests_running
    kv_usage: float = 0.0         # scraped quire:kv_cache_usage_perc (0..1)
    in_flight_at_scrape: int = 0  # our in-flight count when the figures above were read
    scraped_at: float | None = None
    added_at: float = field(default_factory=time.monotonic)
    cooling_until: float = 0.0    # monotonic time; see FAILURE_COOLDOWN
    models: frozenset[str] | None = None  # ids its /v1/models listed (base + LoRA adapters); None: unknown
    down: bool = False            # its last scrape found no one listening (connection refused)

    def may_serve(self, model: str) -> bool:
        """False only when its last /v1/models said it does not serve this model (or adapter)."""
        return self.models is None or model in self.models

    def failed(self) -> None:
        self.cooling_until = time.monotonic() + FAILURE_COOLDOWN

    def cooling(self) -> bool:
        return time.monotonic() < self.cooling_until

    def load(self) -> float:
        """Queued + running on the replica (anyone's), plus what we sent since the last
        scrape (the scrape cannot have seen those yet), plus a KV-pressure term."""
        sent_since = max(0, self.in_flight - self.in_flight_at_scrape)
        queue = self.waiting + self.running if self.scraped_at is not None else self.in_flight
        return max(queue + sent_since, self.in_flight) + KV_USAGE_WEIGHT * self.kv_usage

    def record_scrape(self, waiting: float, running: float, kv_usage: float) -> None:
        self.waiting, self.running, self.kv_usage = waiting, running, kv_usage
        self.in_flight_at_scrape = self.in_flight
        self.scraped_at = time.monotonic()
        self.down = False


def normalize_url(url: str, scheme: str = "http") -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"{scheme}://{url}"
    return url


class BackendSet:
    """The current replicas, keyed by URL. Replacing the set keeps the load figures and the
    in-flight counts of replicas that stay."""

    def __init__(self, urls: list[str] = (), scheme: str = "http") -> None:
        self.scheme = scheme  # of URLs given without one
        self._backends: dict[str, Backend] = {}
        self._changed: asyncio.Event | None = None  # made lazily, on the running loop
        self.on_removed: list = []  # callbacks(url): e.g. the prefix index forgets the replica
        self.replace(urls)

    # --- reads ---------------------------------------------------------------------------
    def all(self) -> list[Backend]:
        return list(self._backends.values())

    def get(self, url: str) -> Backend | None:
        return self._backends.get(normalize_url(url, self.scheme))

    def __len__(self) -> int:
        return len(self._backends)

    # --- changes -------------------------------------------------------------------------
    def replace(self, urls) -> None:
        wanted = {normalize_url(u, self.scheme) for u in urls}
        for url in list(self._backends):
            if url not in wanted:
                del self._backends[url]
                logger.info("backend removed: %s", url)
                for callback in self.on_removed:
                    callback(url)
        for url in sorted(wanted - self._backends.keys()):
            self._backends[url] = Backend(url)
            logger.info("backend added: %s", url)
        self._notify()

    def add(self, url: str) -> None:
        self.replace([*self._backends, url])

    def remove(self, url: str) -> None:
        self.replace([u for u in self._backends if u != normalize_url(url, self.scheme)])

    # --- waiting for one -----------------------------------------------------------------
    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None  # waiters hold the old event; the next change makes a new one

    async def wait_for_backends(self, timeout: float) -> bool:
        """True as soon as the set is non-empty; False after `timeout` seconds without one."""
        deadline = time.monotonic() + timeout
        while not self._backends:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._event().wait(), remaining)
            except asyncio.TimeoutError:
                return bool(self._backends)
        return True
