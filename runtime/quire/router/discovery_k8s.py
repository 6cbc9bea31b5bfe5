"""Replicas from the EndpointSlices of the runtime pods' headless Service, watched.

A list, then a watch from its resourceVersion (`discovery.k8s.io/v1`, label selector
`kubernetes.io/service-name=<service>`); on a broken watch or a 410 Gone, list again after a
short pause. Only ready, non-terminating endpoints count (a pod still loading its model is not
ready: its readiness probe is the runtime's /ready). Plain HTTP with the pod's service account,
so the router needs no Kubernetes client library, only `list` and `watch` on endpointslices.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable

import httpx

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
RELIST_PAUSE = 1.0
WATCH_TIMEOUT = 300  # seconds the API server keeps one watch open


def ready_urls(slices: dict[str, dict], port_name: str | None, default_port: int | None,
               scheme: str = "http") -> set[str]:
    """scheme://address:port of every ready, non-terminating endpoint in the slices."""
    urls = set()
    for s in slices.values():
        ports = s.get("ports") or []
        port = next((p.get("port") for p in ports if port_name and p.get("name") == port_name),
                    None) or next((p.get("port") for p in ports if p.get("port")), default_port)
        if port is None:
            continue
        for ep in s.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            # Kubernetes: a missing `ready` means ready; terminating endpoints are never ready.
            if cond.get("ready") is False or cond.get("terminating"):
                continue
            for address in ep.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                urls.add(f"{scheme}://{host}:{port}")
    return urls


def in_cluster() -> tuple[str, dict, object]:
    """(API URL, auth headers, TLS verification) from the pod's service account."""
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    host = f"[{host}]" if ":" in host else host
    with open(os.path.join(SA_DIR, "token")) as f:
        token = f.read().strip()
    verify = ssl.create_default_context(cafile=os.path.join(SA_DIR, "ca.crt"))
    return f"https://{host}:{port}", {"Authorization": f"Bearer {token}"}, verify


def pod_namespace() -> str:
    try:
        with open(os.path.join(SA_DIR, "namespace")) as f:
            return f.read().strip()
    except OSError:
        return "default"


class EndpointSliceWatch:
    def __init__(self, api_url: str, namespace: str, service: str,
                 on_change: Callable[[set[str]], None], *, port_name: str | None = "http",
                 default_port: int | None = None, headers: dict | None = None,
                 verify: object = True, scheme: str = "http") -> None:
        self.path = (f"{api_url.rstrip('/')}/apis/discovery.k8s.io/v1/namespaces/{namespace}"
                     "/endpointslices")
        self.selector = f"{SERVICE_NAME_LABEL}={service}"
        self.on_change = on_change
        self.port_name = port_name
        self.default_port = default_port
        self.headers = headers or {}
        self.verify = verify  # the API server's certificate, not the replicas'
        self.scheme = scheme  # the replicas'
        self.slices: dict[str, dict] = {}
        self._last: set[str] | None = None

    def _publish(self) -> None:
        urls = ready_urls(self.slices, self.port_name, self.default_port, self.scheme)
        if urls != self._last:
            self._last = urls
            self.on_change(urls)

    async def run(self) -> None:
        async with httpx.AsyncClient(headers=self.headers, verify=self.verify,
                                     timeout=httpx.Timeout(10.0, read=WATCH_TIMEOUT + 30)) as c:
            while True:
                try:
                    version = await self._list(c)
                    await self._watch(c, version)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    logger.warning("EndpointSlice watch (%s): %s; listing again", self.selector, e)
                await asyncio.sleep(RELIST_PAUSE)

    async def _list(self, c: httpx.AsyncClient) -> str:
        r = await c.get(self.path, params={"labelSelector": self.selector})
        r.raise_for_status()
        body = r.json()
        self.slices = {s["metadata"]["name"]: s for s in body.get("items") or []}
        self._publish()
        return body["metadata"]["resourceVersion"]

    async def _watch(self, c: httpx.AsyncClient, version: str) -> None:
        params = {"labelSelector": self.selector, "watch": "1", "resourceVersion": version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_TIMEOUT)}
        async with c.stream("GET", self.path, params=params) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # 410 Gone and friends: the caller lists again
                    raise ValueError(f"watch error: {obj.get('message', obj)}")
                if kind == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                if kind == "DELETED":
                    self.slices.pop(name, None)
                else:
                    self.slices[name] = obj
                self._publish()
