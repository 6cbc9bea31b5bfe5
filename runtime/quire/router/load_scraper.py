"""Reads each replica's /metrics every few seconds: its queue, running count and KV usage.

The runtime's own names first; vLLM's as a fallback, so the router also balances replicas
that are real vLLM servers. A replica that cannot be scraped keeps its last figures (its
in-flight count still moves), and the failure is logged once per streak.

It also reads each replica's /v1/models: the LoRA adapters a replica has loaded, so that a
request for an adapter goes to a replica that serves it (proxy.py). A replica that requires an
API key gets `api_key` (the router's QUIRE_API_KEY); one that does not answer keeps its last list.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

from quire.router.backends import Backend, BackendSet

logger = logging.getLogger(__name__)

WAITING = ("quire:num_requests_waiting", "vllm:num_requests_waiting")
RUNNING = ("quire:num_requests_running", "vllm:num_requests_running")
KV_USAGE = ("quire:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def parse_load(text: str) -> tuple[float, float, float]:
    """(waiting, running, kv usage) from Prometheus text; each summed over its labels (one
    model per replica, but a sum is right for several too, and max for the usage)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in KV_USAGE:
                sums[sample.name] = max(sums.get(sample.name, 0.0), sample.value)
            else:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value

    def first(names: tuple[str, ...]) -> float:
        return next((sums[n] for n in names if n in sums), 0.0)

    return first(WAITING), first(RUNNING), first(KV_USAGE)


class LoadScraper:
    def __init__(self, backends: BackendSet, client: httpx.AsyncClient, interval: float,
                 timeout: float = 2.0, api_key: str | None = None,
                 on_scrape=None) -> None:
        self.backends = backends
        self.on_scrape = on_scrape  # called after each round (flow control re-judges room)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self._failing: set[str] = set()

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._scrape(b) for b in self.backends.all()))
        if self.on_scrape is not None:
            self.on_scrape()

    async def _scrape(self, backend: Backend) -> None:
        await asyncio.gather(self._scrape_load(backend), self._read_models(backend))

    async def _read_models(self, backend: Backend) -> None:
        try:
            r = await self.client.get(backend.url + "/v1/models", headers=self.headers, timeout=self.timeout)
            r.raise_for_status()
            backend.models = frozenset(str(m["id"]) for m in r.json()["data"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            logger.debug("cannot read %s/v1/models: %s", backend.url, e)

    async def _scrape_load(self, backend: Backend) -> None:
        try:
            r = await self.client.get(backend.url + "/metrics", timeout=self.timeout)
            r.raise_for_status()
            backend.record_scrape(*parse_load(r.text))
        except (httpx.HTTPError, ValueError) as e:
            # no one listening: its last figures say nothing of a replica that is gone (a
            # slow or failing answer keeps them: it may be busy)
            backend.down = isinstance(e, httpx.ConnectError)
            if backend.url not in self._failing:
                logger.warning("cannot read %s/metrics: %s", backend.url, e)
                self._failing.add(backend.url)
            return
        self._failing.discard(backend.url)

    async def run(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval)
