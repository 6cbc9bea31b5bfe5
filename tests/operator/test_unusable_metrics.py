"""One pod exporting NaN, +Inf or negative gauges does not stall scaling (issue 13, item 3):
its samples are dropped and counted in status, a Warning Event says so once, and the healthy
pod's signal still scales the LLMDeployment."""

import contextlib
import math

from deployment_controller import DeploymentController
from operator_harness import cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)
from runtime_pod import fixed_metrics_pod, free_port

# Pods 0-2 export metrics; pods started by a scale-up have no server (a failed scrape: missing).
POD_IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"]


def test_scaling_goes_on_with_the_healthy_pods_signal(cluster):
    port = free_port(*POD_IPS)
    with contextlib.ExitStack() as pods:
        pods.enter_context(fixed_metrics_pod(POD_IPS[0], port, waiting=math.nan, kv_usage=math.inf))
        pods.enter_context(fixed_metrics_pod(POD_IPS[1], port, waiting=-5, kv_usage=0.1))
        pods.enter_context(fixed_metrics_pod(POD_IPS[2], port, waiting=12, kv_usage=0.1))  # the healthy one
        with running_operator():
            cluster.create(llmdeployment("chat", port=port, replicas=3, autoscaling={
                "enabled": True, "minReplicas": 1, "maxReplicas": 5, "targetQueueDepth": 2, "pollIntervalSeconds": 1}))
            with DeploymentController(cluster, "chat", POD_IPS):
                # queue 12 on the one usable pod, the two others missing (idle, conservatively):
                # 12 / (2 × 3) = 2 × the target, so 3 → 5 (maxReplicas).
                wait_for(lambda: cluster.llmd("chat")["spec"]["replicas"] == 5, timeout=30, what="the scale-up")
                scaler = wait_for(lambda: (a := cluster.llmd("chat")["status"].get("autoscaler") or {})
                                  .get("droppedSamples") == 3 and a, what="the dropped samples in status")
                warnings = wait_for(lambda: [e for e in cluster.events("chat") if e["reason"] == "UnusableMetrics"])

    # 3: chat-0's two gauges and chat-1's negative queue
    assert scaler["signal"] == "queueDepth" and scaler["observedQueueDepth"] == 12
    assert "chat-0 quire:num_requests_waiting=nan" in scaler["message"]
    assert "chat-1 quire:num_requests_waiting=-5.0" in scaler["message"]
    # Announced when it started, not on every poll.
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
    assert "chat-0 quire:kv_cache_usage_perc=inf" in warnings[0]["message"]
    scaled = [e for e in cluster.events("chat") if e["reason"] == "ScaledUp"]
    assert scaled
