"""The operator tests' harness: an emulated API server with the CRD installed, a kubectl-like
client, the operator in a thread.

Not a conftest.py on purpose: the runtime tests import their conftest by the name `conftest`, and
two such modules replace each other in sys.modules. Test modules import the `cluster` fixture
from here instead.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import foreign_crds
import kubernetes
import pytest
import requests
import yaml
from kopf.testing import KopfRunner

from quire_operator import api_calls, names
from quire_operator.kube import resource_path

from child_processes import die_with_parent
from kube_emulator import (
    RunningEmulator,  # tests/operator is on sys.path (no __init__.py: no `operator` package)
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "llmdeployments.quire.dev.yaml"
TEST_AGENT = "quire-tests"  # the tests' own requests are not the operator's API calls
LLMD_API = f"{names.GROUP}/{names.VERSION}"


def api_path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
             sub: str | None = None) -> str:
    group, _, version = api_version.rpartition("/")
    return resource_path(group, version, plural, namespace, name, sub)


class Cluster:
    """What a test does with kubectl, plus playing the controllers the emulator lacks."""

    def __init__(self, running: RunningEmulator) -> None:
        self.running = running
        self.url = running.url
        self.http = requests.Session()
        self.http.headers["User-Agent"] = TEST_AGENT
        self.http.trust_env = False

    def _call(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return self.http.request(method, self.url + path, timeout=10, **kwargs)

    def create(self, obj: dict, namespace: str | None = "default") -> dict:
        plural = PLURALS[obj["kind"]]
        response = self._call("POST", api_path(obj["apiVersion"], plural, namespace), json=obj)
        assert response.status_code == 201, response.text
        return response.json()

    def get(self, api_version: str, plural: str, name: str, namespace: str = "default",
            sub: str | None = None) -> dict | None:
        response = self._call("GET", api_path(api_version, plural, namespace, name, sub))
        if response.status_code == 404:
            return None
        assert response.status_code == 200, response.text
        return response.json()

    def patch(self, api_version: str, plural: str, name: str, patch: dict, namespace: str = "default",
              sub: str | None = None) -> dict:
        response = self._call("PATCH", api_path(api_version, plural, namespace, name, sub), json=patch,
                              headers={"Content-Type": "application/merge-patch+json"})
        assert response.status_code == 200, response.text
        return response.json()

    def delete(self, api_version: str, plural: str, name: str, namespace: str = "default") -> None:
        response = self._call("DELETE", api_path(api_version, plural, namespace, name))
        assert response.status_code in (200, 404), response.text

    def list(self, api_version: str, plural: str, namespace: str = "default", selector: str | None = None) -> list[dict]:
        params = {"labelSelector": selector} if selector else {}
        response = self._call("GET", api_path(api_version, plural, namespace), params=params)
        assert response.status_code == 200, response.text
        return response.json()["items"]

    # shortcuts for the objects these tests look at
    def llmd(self, name: str) -> dict | None:
        return self.get(LLMD_API, names.PLURAL, name)

    def deployment(self, name: str) -> dict | None:
        return self.get("apps/v1", "deployments", name)

    def service(self, name: str) -> dict | None:
        return self.get("v1", "services", name)

    def events(self, name: str) -> list[dict]:
        return [e for e in self.list("v1", "events") if e.get("involvedObject", {}).get("name") == name]

    def mark_deployment_available(self, name: str, ready: int | None = None) -> dict:
        """Play the Deployment controller: the rollout of the current generation is done."""
        dep = self.deployment(name)
        want = dep["spec"]["replicas"]
        ready = want if ready is None else ready
        return self.patch("apps/v1", "deployments", name, {"status": {
            "observedGeneration": dep["metadata"]["generation"], "replicas": want, "updatedReplicas": want,
            "readyReplicas": ready, "availableReplicas": ready,
            "conditions": [{"type": "Available", "status": "True" if ready else "False"}],
        }}, sub="status")

    def writes(self, agent_prefix: str = "") -> list[str]:
        """The operator's writes so far, as 'METHOD path' lines."""
        def collect(emulator: Any) -> list[str]:
            return [f"{r.method.value} {r.url.path}" for r in emulator._requests
                    if r.method.value in ("POST", "PATCH", "PUT", "DELETE")
                    and r.headers.get("User-Agent") != TEST_AGENT]
        return self.running.call(collect)

    def operator_calls(self) -> list[tuple[str, str]]:
        def collect(emulator: Any) -> list[tuple[str, str]]:
            return [(r.method.value, str(r.url.path_qs)) for r in emulator._requests
                    if r.headers.get("User-Agent") != TEST_AGENT]
        return self.running.call(collect)


PLURALS = {"LLMDeployment": names.PLURAL, "Pod": "pods", "Secret": "secrets", "Deployment": "deployments", "Service": "services",
           "CustomResourceDefinition": "customresourcedefinitions", "EndpointSlice": "endpointslices"}


def wait_for(check: Callable[[], Any], timeout: float = 15.0, interval: float = 0.1, what: str = "") -> Any:
    """Poll until check() is truthy; fail with the last value otherwise."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}: last value {value!r}")


def _setup(emulator: Any) -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    emulator.register_builtins()
    emulator.register_crd(crd)
    foreign_crds.install(emulator)  # GIE, Gateway API, KEDA and LWS are installed, and validate


@pytest.fixture
def cluster(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    with RunningEmulator(_setup) as running:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": running.url}}],
            "users": [{"name": "emulator", "user": {"token": "test"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
        }))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        # kopf's login reads the kubernetes package's default, which it took from the env at import.
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        monkeypatch.setenv("QUIRE_DEFAULT_IMAGE", "quire-test:latest")
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            monkeypatch.delenv(var, raising=False)
        c = Cluster(running)
        c.create(crd_object(), namespace=None)
        yield c
        # Every request the operator made must be one the chart's RBAC grants.
        undeclared = [(m, p) for m, p in c.operator_calls()
                      if (call := api_calls.classify(m, p)) is not None and not api_calls.allowed(*call)]
        assert not undeclared, f"API calls missing from quire_operator.api_calls: {undeclared}"


def crd_object() -> dict:
    return yaml.safe_load(CRD_PATH.read_text())


@contextlib.contextmanager
def running_operator() -> Iterator[KopfRunner]:
    """The operator, as `quire-operator -A` runs it, until the block ends."""
    args = ["run", "--all-namespaces", "--standalone", "--verbose", "-m", "quire_operator.handlers"]
    with KopfRunner(args, timeout=30) as runner:
        yield runner
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None


def llmdeployment(name: str = "chat", **spec: Any) -> dict:
    return {"apiVersion": LLMD_API, "kind": names.KIND, "metadata": {"name": name}, "spec": spec}


# Short enough for a test, long enough for a loaded CI machine to renew the Lease in time.
TIMINGS = ["--lease-duration", "10", "--renew-deadline", "8", "--retry-period", "1"]


@contextlib.contextmanager
def operator_process(cluster, tmp_path: pathlib.Path, identity: str = "operator",
                     lease: str = "quire-operator") -> Iterator[subprocess.Popen]:
    """`quire-operator -A` as its own process (leader election on, as deployed), authenticating
    as `identity`; its log is tmp_path / f"{identity}.log"."""
    kubeconfig = tmp_path / f"kubeconfig-{identity}"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": cluster.url}}],
        "users": [{"name": identity, "user": {"token": identity}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": identity}}],
    }))
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy")}
    env.update(KUBECONFIG=str(kubeconfig), QUIRE_DEFAULT_IMAGE="quire-test:latest")
    log = (tmp_path / f"{identity}.log").open("w")
    process = subprocess.Popen(die_with_parent(
        [sys.executable, "-m", "quire_operator", "--all-namespaces", "--liveness", "", "--identity", identity,
         "--lease-name", lease, "--lease-namespace", "default", *TIMINGS]),
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        log.close()
