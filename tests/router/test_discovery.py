"""Backends from a watched EndpointSlice, against the operator tests' API emulator: a request
held while the Service has no ready endpoint completes once one becomes ready."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from urllib.parse import urlparse

import requests

from router_harness import ROOT, fake_backend, router_state, wait_until
from router_harness import InProcessRouter as router

SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"


def _kube_emulator():
    """tests/operator/kube_emulator.py, loaded by path and only read."""
    if "kube_emulator" in sys.modules:
        return sys.modules["kube_emulator"]
    spec = importlib.util.spec_from_file_location(
        "kube_emulator", ROOT / "tests" / "operator" / "kube_emulator.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kube_emulator"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _setup(emulator, kube) -> None:
    emulator.register_builtins()
    emulator.register("discovery.k8s.io", "v1", "endpointslices", kube.ResourceType("EndpointSlice"))


def endpoint_slice(name: str, address: str, port: int, ready: bool, service: str = "llm-pods") -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [address], "conditions": {"ready": ready}}]}


def test_held_request_completes_when_the_endpoint_slice_gets_a_ready_endpoint():
    kube = _kube_emulator()
    with kube.RunningEmulator(lambda e: _setup(e, kube)) as api, \
            fake_backend("pod", "127.0.0.14") as pod, \
            router("--k8s-service", "llm-pods", "--k8s-namespace", "default", "--kube-api",
                   api.url, "--hold-timeout", "60") as r:
        where = urlparse(pod.url)
        # The pod exists but is not ready yet (its model loads): nothing to route to.
        created = requests.post(api.url + SLICES, json=endpoint_slice(
            "llm-pods-abc", where.hostname, where.port, ready=False), timeout=5)
        assert created.status_code == 201
        # A slice of another Service is not ours.
        requests.post(api.url + SLICES, json=endpoint_slice(
            "other-xyz", where.hostname, where.port, ready=True, service="other"), timeout=5)
        result = {}
        t = threading.Thread(target=lambda: result.update(response=requests.post(
            r.url + "/v1/completions", json={"prompt": "cold start"}, timeout=60)), daemon=True)
        t.start()
        wait_until(lambda: router_state(r)["pending_requests"] == 1, 30, "the request to be held")
        assert router_state(r)["backends"] == []

        ready = endpoint_slice("llm-pods-abc", where.hostname, where.port, ready=True)
        patched = requests.patch(api.url + SLICES + "/llm-pods-abc", json=ready, timeout=5,
                                 headers={"Content-Type": "application/merge-patch+json"})
        assert patched.status_code == 200
        t.join(30)
        assert result["response"].status_code == 200
        assert result["response"].json()["backend"] == "pod"
        assert [b["url"] for b in router_state(r)["backends"]] == [pod.url]

        # The slice goes away (scaled to zero): so does the backend.
        requests.delete(api.url + SLICES + "/llm-pods-abc", timeout=5)
        wait_until(lambda: router_state(r)["backends"] == [], 30, "the backend to be dropped")


def test_scale_from_zero_and_back_driven_by_the_routers_metrics():
    """The operator's part played by the test with the operator's own pure functions: read the
    router's /metrics, decide, "scale" (start a replica and publish its ready endpoint), and
    after the idle window scale back to zero."""
    from quire_operator.scale_to_zero import (
        ColdStart,
        cold_start_finished,
        decide_scale_to_zero,
        router_signal_from_metrics,
    )
    kube = _kube_emulator()
    with kube.RunningEmulator(lambda e: _setup(e, kube)) as api, \
            router("--k8s-service", "llm-pods", "--k8s-namespace", "default", "--kube-api",
                   api.url, "--hold-timeout", "60") as r:

        def decision(current: int, idle_window: float):
            signal = router_signal_from_metrics(requests.get(r.url + "/metrics", timeout=5).text)
            return signal, decide_scale_to_zero(
                current_replicas=current, ready_replicas=current, signal=signal,
                now=time.time(), idle_window_seconds=idle_window, min_replicas=0, max_replicas=2)

        assert decision(0, 30)[1].replicas == 0  # nothing asked: stay at zero
        result = {}
        t = threading.Thread(target=lambda: result.update(response=requests.post(
            r.url + "/v1/completions", json={"prompt": "wake up"}, timeout=60)), daemon=True)
        t.start()
        wait_until(lambda: decision(0, 30)[1].replicas == 1, 30, "a scale-from-zero decision")
        cold = ColdStart(decided_at=time.time())
        with fake_backend("pod", "127.0.0.15") as pod:  # the Deployment controller's part
            where = urlparse(pod.url)
            requests.post(api.url + SLICES, json=endpoint_slice(
                "llm-pods-1", where.hostname, where.port, ready=True), timeout=5)
            t.join(30)
            assert result["response"].status_code == 200
            signal, d = decision(1, 30)
            assert d.reason == "within-idle-window"
            cold = cold_start_finished(cold, signal)
            assert cold.seconds is not None and 0 <= cold.seconds < 30
            # No more requests: after the idle window (1 s here), back to zero.
            wait_until(lambda: decision(1, 1.0)[1].replicas == 0, 30, "an idle decision")
            requests.delete(api.url + SLICES + "/llm-pods-1", timeout=5)
            wait_until(lambda: router_state(r)["backends"] == [], 30, "the backend to go")
