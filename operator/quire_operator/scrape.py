"""Read the runtime's Prometheus metrics straight from each ready pod (no Prometheus needed)."""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_SECONDS = 2.0
MAX_PARALLEL_SCRAPES = 16
# Pod IPs are reached directly: an HTTP(S)_PROXY in the operator's environment must not apply.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def parse_metrics(text: str) -> dict[str, float]:
    """One value per sample name: counts summed over label sets, fractions (`_perc`) maxed."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.endswith("_perc"):
                values[name] = max(values.get(name, 0.0), sample.value)
            else:
                values[name] = values.get(name, 0.0) + sample.value
    return values


def fetch(ip: str, port: int, timeout: float = SCRAPE_TIMEOUT_SECONDS) -> str | None:
    """A pod's /metrics text, or None if it does not answer well."""
    host = f"[{ip}]" if ":" in ip else ip
    try:
        with _opener.open(f"http://{host}:{port}/metrics", timeout=timeout) as response:
            return response.read().decode("utf-8", errors="replace")
    except Exception as e:  # any failure means "no data from this pod", never a crash
        log.debug("scraping %s:%s failed: %s", ip, port, e)
        return None


def scrape(ip: str, port: int, timeout: float = SCRAPE_TIMEOUT_SECONDS) -> dict[str, float] | None:
    """A pod's metrics, or None if it does not answer well (counted as missing, not as zero)."""
    text = fetch(ip, port, timeout)
    if text is None:
        return None
    try:
        return parse_metrics(text)
    except Exception as e:
        log.debug("unparsable metrics from %s:%s: %s", ip, port, e)
        return None


def _all(ips: Iterable[str], get: Callable[[str], Any]) -> dict[str, Any]:
    ips = list(ips)
    if not ips:
        return {}
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_SCRAPES, len(ips))) as pool:
        return dict(zip(ips, pool.map(get, ips)))


def scrape_all(ips: Iterable[str], port: int) -> dict[str, Mapping[str, float] | None]:
    return _all(ips, lambda ip: scrape(ip, port))
