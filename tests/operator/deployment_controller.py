"""Plays the Deployment and kubelet controllers that the emulator lacks, for one Deployment.

It keeps one Pod object per wanted replica, each bound to the next free runtime pod's IP (ready
when its server is), and writes the Deployment's status from them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from operator_harness import Cluster


class DeploymentController:
    def __init__(self, cluster: Cluster, name: str, ips: Sequence[str]) -> None:
        self.cluster, self.name, self.ips = cluster, name, list(ips)
        self.replica_history: list[int] = []  # every replica count the Deployment asked for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deployment-controller", daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> DeploymentController:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        if self.error is not None and exc[0] is None:
            raise self.error

    def pods(self) -> list[dict]:
        return self.cluster.list("v1", "pods", selector=f"quire.dev/llmdeployment={self.name}")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._sync()
                time.sleep(0.1)
        except BaseException as e:  # reported when the test leaves the block
            self.error = e

    def _sync(self) -> None:
        dep = self.cluster.deployment(self.name)
        if dep is None:
            return
        want = dep["spec"]["replicas"]
        if not self.replica_history or self.replica_history[-1] != want:
            self.replica_history.append(want)
        have = {p["metadata"]["name"]: p for p in self.pods()}
        for i, ip in enumerate(self.ips):
            pod_name = f"{self.name}-{i}"
            if i < want and pod_name not in have:
                self._start_pod(dep, pod_name, ip)
            elif i >= want and pod_name in have:
                self.cluster.delete("v1", "pods", pod_name)
        running = min(want, len(self.ips))
        status = {"observedGeneration": dep["metadata"]["generation"], "replicas": running,
                  "updatedReplicas": running, "readyReplicas": running, "availableReplicas": running}
        if any(dep.get("status", {}).get(k) != v for k, v in status.items()):
            self.cluster.patch("apps/v1", "deployments", self.name, {"status": status}, sub="status")

    def _start_pod(self, dep: dict, pod_name: str, ip: str) -> None:
        template = dep["spec"]["template"]
        self.cluster.create({"apiVersion": "v1", "kind": "Pod",
                             "metadata": {"name": pod_name, "labels": template["metadata"]["labels"]},
                             "spec": template["spec"]})
        self.cluster.patch("v1", "pods", pod_name, {"status": {
            "phase": "Running", "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}]}}, sub="status")
