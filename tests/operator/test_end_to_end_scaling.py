"""The operator scales real serving pods (on 127.0.0.2 and 127.0.0.3) from the queue it scrapes."""

import time
from concurrent.futures import ThreadPoolExecutor

import requests

from quire_operator import names

from deployment_controller import DeploymentController
from operator_harness import LLMD_API, cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)
from runtime_pod import free_port, start_runtime_pods

POD_IPS = ["127.0.0.2", "127.0.0.3"]
SCALE_DOWN_WINDOW = 5
POLL = 1


class Load:
    """Concurrent clients sending completions to the ready pods, as the Service would spread them."""

    def __init__(self, controller: DeploymentController, port: int, clients: int = 16) -> None:
        self.controller, self.port, self.clients = controller, port, clients
        self.running = True
        self.sent = 0
        self._pool = ThreadPoolExecutor(clients)

    def __enter__(self) -> "Load":
        for i in range(self.clients):
            self._pool.submit(self._client, i)
        return self

    def stop(self) -> float:
        """Stop sending; returns when the clients stopped (before the queues drain)."""
        self.running = False
        stopped = time.monotonic()
        self._pool.shutdown(wait=True)
        return stopped

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _client(self, i: int) -> None:
        session = requests.Session()
        session.trust_env = False
        deadline = time.monotonic() + 60  # bounded, whatever happens
        while self.running and time.monotonic() < deadline:
            ips = [p["status"]["podIP"] for p in self.controller.pods() if p.get("status", {}).get("podIP")]
            if not ips:
                time.sleep(0.05)
                continue
            ip = ips[(i + self.sent) % len(ips)]
            session.post(f"http://{ip}:{self.port}/v1/completions",
                         json={"model": "smollm2", "prompt": "Say hello", "max_tokens": 8}, timeout=30)
            self.sent += 1


def _autoscaler(cluster) -> dict:
    """The autoscaler's record in the LLMDeployment's status: empty until the operator's first
    status write (a resource just created has no status at all)."""
    return (cluster.llmd("chat").get("status") or {}).get("autoscaler") or {}


def test_scales_up_under_load_and_down_after_the_window(cluster):
    port = free_port(*POD_IPS)
    with start_runtime_pods(POD_IPS, port), running_operator():
        cluster.create(llmdeployment("chat", port=port, replicas=1, autoscaling={
            "enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 2,
            "targetKVCacheUtilization": 0.9, "pollIntervalSeconds": POLL,
            "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW}))
        with DeploymentController(cluster, "chat", POD_IPS) as controller:
            wait_for(lambda: len(controller.pods()) == 1, what="the first pod")
            # Idle: the autoscaler scrapes an empty queue and stays at minReplicas.
            wait_for(lambda: _autoscaler(cluster).get("reason"), what="a first autoscaler decision")
            assert cluster.llmd("chat")["spec"]["replicas"] == 1

            with Load(controller, port) as load:
                wait_for(lambda: cluster.llmd("chat")["spec"]["replicas"] == 2, timeout=20, what="scale-up")
                # The decision is recorded in status just after the replicas change.
                scaled_up = wait_for(lambda: (a := _autoscaler(cluster)).get("lastScaleTime") and a,
                                     what="the recorded decision")
                wait_for(lambda: len(controller.pods()) == 2, what="the second pod")
                # 16 clients keep ~6 requests waiting per pod, 3× the target even at two pods:
                # the autoscaler keeps asking for more than maxReplicas, and must stay at 2.
                time.sleep(3 * POLL)
                stopped = load.stop()
            assert load.sent > 0

            wait_for(lambda: cluster.llmd("chat")["spec"]["replicas"] == 1, timeout=SCALE_DOWN_WINDOW + 10,
                     what="scale-down")
            waited = time.monotonic() - stopped
            wait_for(lambda: controller.replica_history[-1] == 1, what="the Deployment to follow")
            events = cluster.events("chat")

    assert scaled_up["signal"] == "queueDepth"
    assert scaled_up["observedQueueDepth"] >= 2
    assert scaled_up["desiredReplicas"] == 2 and scaled_up["lastScaleTime"]
    # Not before the stabilization window: the last poll that saw the full load may have come up to
    # two poll intervals (the timer ticks each second) before the clients stopped.
    assert waited >= SCALE_DOWN_WINDOW - 2 * POLL, waited
    # Never above maxReplicas, neither the LLMDeployment nor its Deployment.
    history = cluster.running.call(lambda e: [v["spec"]["replicas"] for v in
                                              e.objects[LLMD_API + "/" + names.PLURAL, "default", "chat"].history if v])
    assert max(history) == 2 and max(controller.replica_history) == 2
    assert controller.replica_history == [1, 2, 1]
    reasons = [(e["reason"], e["message"]) for e in events if e["reason"] in ("ScaledUp", "ScaledDown")]
    assert [r for r, _ in reasons] == ["ScaledUp", "ScaledDown"]
    assert "signal: queueDepth" in reasons[0][1] and "queue depth" in reasons[0][1]
