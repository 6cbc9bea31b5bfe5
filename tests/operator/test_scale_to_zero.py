"""Scale to zero and back (issue 17): the operator reads the router pods' /metrics and moves the
replica count across the 0 <-> 1 edge; the decision and the cold start land in status and Events.

The tests play the controllers the emulator lacks: the router Deployment's pod (a Pod object
bound to a stand-in or a real `python -m quire.router`), the runtime Deployment's pods
(DeploymentController) and, for the real router, the EndpointSlice controller.
"""

import threading
import time

import requests

from deployment_controller import DeploymentController
from operator_harness import cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)
from runtime_pod import RuntimePod, fixed_router_pod, free_port, real_router, start_runtime_pod

ROUTER_IP = "127.0.0.5"
RUNTIME_IPS = ["127.0.0.6"]
IDLE_WINDOW = 10  # the CRD's minimum
TIMEOUT = 45  # generous: the machine may be loaded; every wait polls until true


def zero_spec(port: int, **extra) -> dict:
    return dict(port=port, replicas=0, router={"enabled": True, "routing": "round-robin"},
                autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 2, "pollIntervalSeconds": 1,
                             "idleWindowSeconds": IDLE_WINDOW}, **extra)


def start_router_pod(cluster, port: int) -> None:
    """Play the router Deployment's controller and kubelet: one ready pod at ROUTER_IP:port."""
    router = wait_for(lambda: cluster.deployment("chat-router"), what="the router Deployment")
    template = router["spec"]["template"]
    spec = template["spec"]
    spec["containers"][0]["ports"][0]["containerPort"] = port  # where this stand-in listens
    cluster.create({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "chat-router-0", "labels": template["metadata"]["labels"]}, "spec": spec})
    cluster.patch("v1", "pods", "chat-router-0", {"status": {
        "phase": "Running", "podIP": ROUTER_IP, "conditions": [{"type": "Ready", "status": "True"}]}}, sub="status")


def scale_to_zero_status(cluster) -> dict:
    return (cluster.llmd("chat").get("status") or {}).get("scaleToZero") or {}


def reasons(cluster) -> list[str]:
    return [e["reason"] for e in cluster.events("chat")]


def test_scales_from_zero_on_held_requests_and_back_after_the_idle_window(cluster):
    runtime_port = free_port(*RUNTIME_IPS)
    router_port = free_port(ROUTER_IP)
    with fixed_router_pod(ROUTER_IP, router_port) as router, running_operator():
        figures = router.engine
        cluster.create(llmdeployment("chat", **zero_spec(runtime_port)))
        start_router_pod(cluster, router_port)
        pod = RuntimePod(RUNTIME_IPS[0], runtime_port)
        try:
            with DeploymentController(cluster, "chat", RUNTIME_IPS) as controller:
                # Nothing held: it stays at zero.
                wait_for(lambda: scale_to_zero_status(cluster).get("reason") == "idle", timeout=TIMEOUT,
                         what="a first decision at zero")
                assert cluster.llmd("chat")["spec"]["replicas"] == 0

                # A request is held: 0 -> 1, recorded and announced.
                figures.pending, figures.last_request = 1, time.time()
                wait_for(lambda: cluster.llmd("chat")["spec"]["replicas"] == 1, timeout=TIMEOUT,
                         what="scale from zero")
                state = wait_for(lambda: (s := scale_to_zero_status(cluster)).get("lastScaleTime") and s,
                                 timeout=TIMEOUT, what="the recorded decision")
                assert state["coldStart"]["decidedAt"] > 0 and "seconds" not in state["coldStart"]
                assert wait_for(lambda: "ScaledFromZero" in reasons(cluster), timeout=TIMEOUT, what="the Event")
                wait_for(lambda: len(controller.pods()) == 1, timeout=TIMEOUT, what="the replica's pod")
                wait_for(lambda: cluster.deployment("chat")["spec"]["replicas"] == 1, timeout=TIMEOUT,
                         what="the Deployment to follow")
                # While the request is still held, the replica is never taken away.
                time.sleep(3)
                assert cluster.llmd("chat")["spec"]["replicas"] == 1
                assert "coldStartSeconds" not in scale_to_zero_status(cluster)

                # The replica answers: the router saw its first byte; the cold start is measured.
                decided = scale_to_zero_status(cluster)["coldStart"]["decidedAt"]
                figures.pending, figures.last_first_byte, figures.last_request = 0, decided + 1.5, time.time()
                done = wait_for(lambda: (s := scale_to_zero_status(cluster)).get("coldStartSeconds") is not None and s,
                                timeout=TIMEOUT, what="the cold start in status")
                assert done["coldStartSeconds"] == 1.5
                assert done["coldStart"]["seconds"] == 1.5
                events = wait_for(lambda: [e for e in cluster.events("chat") if e["reason"] == "ColdStart"],
                                  timeout=TIMEOUT, what="the ColdStart Event")
                assert "1.5s" in events[0]["message"]
                # Within the idle window: still one replica.
                assert cluster.llmd("chat")["spec"]["replicas"] == 1

                # No request for longer than the idle window: back to zero.
                figures.last_request = time.time() - IDLE_WINDOW - 5
                wait_for(lambda: cluster.llmd("chat")["spec"]["replicas"] == 0, timeout=TIMEOUT,
                         what="scale to zero")
                wait_for(lambda: scale_to_zero_status(cluster).get("reason") == "idle", timeout=TIMEOUT,
                         what="the idle decision")
                assert wait_for(lambda: "ScaledToZero" in reasons(cluster), timeout=TIMEOUT, what="the Event")
                wait_for(lambda: not controller.pods(), timeout=TIMEOUT, what="the pod to go")
                assert controller.replica_history[-3:] == [0, 1, 0] or controller.replica_history[-2:] == [1, 0]

                # And again: a fresh cold start, without the last one's figures.
                figures.pending, figures.last_request = 1, time.time()
                wait_for(lambda: cluster.llmd("chat")["spec"]["replicas"] == 1, timeout=TIMEOUT,
                         what="the second scale from zero")
                fresh = wait_for(lambda: (c := scale_to_zero_status(cluster).get("coldStart") or {})
                                 .get("decidedAt", 0) > decided and c, timeout=TIMEOUT, what="a new cold start")
                assert "seconds" not in fresh and "firstTokenAt" not in fresh
        finally:
            pod.stop()


def test_a_router_that_does_not_answer_never_scales_to_zero(cluster):
    runtime_port = free_port(*RUNTIME_IPS)
    router_port = free_port(ROUTER_IP)  # nothing listens there
    with running_operator():
        spec = zero_spec(runtime_port)
        spec["replicas"] = 1
        cluster.create(llmdeployment("chat", **spec))
        start_router_pod(cluster, router_port)
        wait_for(lambda: scale_to_zero_status(cluster).get("reason") == "router-unknown", timeout=TIMEOUT,
                 what="the router-unknown decision")
        assert cluster.llmd("chat")["spec"]["replicas"] == 1


def endpoint_slice(ip: str, port: int) -> dict:
    """What the EndpointSlice controller writes for the headless Service's one ready pod."""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": "chat-pods-abc", "labels": {"kubernetes.io/service-name": "chat-pods"}},
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}]}


def test_a_request_held_by_the_real_router_completes_after_scale_from_zero(cluster):
    runtime_port = free_port(*RUNTIME_IPS)
    router_port = free_port(ROUTER_IP)
    with running_operator():
        cluster.create(llmdeployment("chat", **zero_spec(runtime_port)))
        wait_for(lambda: cluster.service("chat-pods"), timeout=TIMEOUT, what="the headless Service")
        with real_router(ROUTER_IP, router_port, "--k8s-service", "chat-pods", "--k8s-namespace", "default",
                         "--kube-api", cluster.url, "--routing", "round-robin", "--hold-timeout", "120"):
            start_router_pod(cluster, router_port)
            # The replica's server (`quire serve`, or its stand-in with QUIRE_E2E_RUNTIME=stand-in) is
            # started ahead: the Pod object the controller binds to it appears only on scale-up.
            with start_runtime_pod(RUNTIME_IPS[0], runtime_port), \
                    DeploymentController(cluster, "chat", RUNTIME_IPS) as controller:
                wait_for(lambda: scale_to_zero_status(cluster).get("reason") == "idle", timeout=TIMEOUT,
                         what="a first decision at zero")
                result: dict = {}
                session = requests.Session()
                session.trust_env = False
                client = threading.Thread(target=lambda: result.update(response=session.post(
                    f"http://{ROUTER_IP}:{router_port}/v1/completions",
                    json={"model": "smollm2", "prompt": "cold start", "max_tokens": 4}, timeout=120)), daemon=True)
                client.start()
                # The router holds it; the operator reads that and scales 0 -> 1.
                wait_for(lambda: cluster.llmd("chat")["spec"]["replicas"] == 1, timeout=TIMEOUT,
                         what="scale from zero")
                assert result == {}  # still held: no replica yet
                # Play the EndpointSlice controller: the replica's pod is ready.
                wait_for(lambda: controller.pods(), timeout=TIMEOUT, what="the replica's pod")
                created = cluster.create(endpoint_slice(RUNTIME_IPS[0], runtime_port))
                assert created["metadata"]["name"] == "chat-pods-abc"
                client.join(120)  # a real model answers too, on a loaded machine
                assert result["response"].status_code == 200, result["response"].text
                assert result["response"].json()["choices"][0]["finish_reason"] in ("length", "stop")
                # The router saw the first byte: the cold start is measured.
                state = wait_for(lambda: (s := scale_to_zero_status(cluster)).get("coldStartSeconds") is not None
                                 and s, timeout=TIMEOUT, what="the cold start in status")
                assert 0 < state["coldStartSeconds"] < TIMEOUT * 2
                assert wait_for(lambda: "ColdStart" in reasons(cluster), timeout=TIMEOUT, what="the Event")
