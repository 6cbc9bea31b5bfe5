"""Read the runtime's Prometheus metrics straight from each ready pod (no Prometheus needed).

With spec.tls the pods speak HTTPS: `tls` is the SSL context that verifies them (pod_tls.py)."""

from __future__ import annotations

import logging
import ssl
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


def pod_url(ip: str, port: int, path: str, tls: ssl.SSLContext | None) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"{'https' if tls else 'http'}://{host}:{port}{path}"


def pod_opener(tls: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    """An opener for pod IPs: no proxy, and over HTTPS only the certificates `tls` trusts."""
    if tls is None:
        return _opener
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=tls))


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


def fetch(ip: str, port: int, timeout: float = SCRAPE_TIMEOUT_SECONDS, tls: ssl.SSLContext | None = None) -> str | None:
    """A pod's /metrics text, or None if it does not answer well."""
    try:
        with pod_opener(tls).open(pod_url(ip, port, "/metrics", tls), timeout=timeout) as response:
            return response.read().decode("utf-8", errors="replace")
    except Exception as e:  # any failure means "no data from this pod", never a crash
        log.debug("scraping %s:%s failed: %s", ip, port, e)
        return None


def scrape(ip: str, port: int, timeout: float = SCRAPE_TIMEOUT_SECONDS,
           tls: ssl.SSLContext | None = None) -> dict[str, float] | None:
    """A pod's metrics, or None if it does not answer well (counted as missing, not as zero)."""
    text = fetch(ip, port, timeout, tls)
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


def scrape_all(ips: Iterable[str], port: int, tls: ssl.SSLContext | None = None) -> dict[str, Mapping[str, float] | None]:
    return _all(ips, lambda ip: scrape(ip, port, tls=tls))
