"""The running operator writes, updates and removes the InferencePool, HTTPRoute and KEDA
ScaledObject as the spec says (issue 37), in an API server that validates them against the
vendored upstream CRDs; and its own autoscaler leaves a KEDA-scaled LLMDeployment alone."""

import contextlib
import time

from foreign_crds import api_version, problems

from quire_operator import names

from deployment_controller import DeploymentController
from operator_harness import (  # noqa: F401 (cluster is a fixture)
    LLMD_API,
    cluster,
    llmdeployment,
    operator_process,
    running_operator,
    wait_for,
)
from runtime_pod import fixed_metrics_pod, free_port

POOL, ROUTE, SCALED = api_version("InferencePool"), api_version("HTTPRoute"), api_version("ScaledObject")
OBJECTIVE = api_version("InferenceObjective")
GATEWAY = {"name": "inference-gateway", "namespace": "gateways"}
PROMETHEUS = "http://prometheus.monitoring.svc:9090"
KEDA = {"enabled": True, "provider": "keda", "minReplicas": 2, "maxReplicas": 6,
        "keda": {"prometheusAddress": PROMETHEUS}}


def pool(cluster):
    return cluster.get(POOL, "inferencepools", "chat")


def route(cluster):
    return cluster.get(ROUTE, "httproutes", "chat")


def scaled_object(cluster):
    return cluster.get(SCALED, "scaledobjects", "chat")


def runtime_args(cluster):
    (container,) = cluster.deployment("chat")["spec"]["template"]["spec"]["containers"]
    return container["args"]


def deleted_messages(cluster):
    return [e["message"] for e in cluster.events("chat") if e["reason"] == "Deleted"]


def change_spec(cluster, spec):
    cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": spec})


def test_the_pool_and_route_follow_the_spec_until_turned_off(cluster):
    with running_operator():
        llmd = cluster.create(llmdeployment("chat", port=9000, router={"enabled": True}, gateway={
            "inferencePool": {"enabled": True}, "httpRoute": {"parentRefs": [GATEWAY]}}))
        created_pool = wait_for(lambda: pool(cluster), what="the InferencePool")
        created_route = wait_for(lambda: route(cluster), what="the HTTPRoute")
        assert problems(created_pool) == [] and problems(created_route) == []
        for obj in (created_pool, created_route):
            (ref,) = obj["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["uid"]) == ("LLMDeployment", llmd["metadata"]["uid"])
        assert created_pool["spec"]["selector"]["matchLabels"] == {names.SELECTOR_LABEL: "chat"}
        assert created_pool["spec"]["targetPorts"] == [{"number": 9000}]
        assert created_pool["spec"]["endpointPickerRef"]["name"] == "chat"
        assert created_route["spec"]["parentRefs"] == [GATEWAY]
        # The pool's pods export vLLM's names; the router's Service offers the ext_proc port.
        wait_for(lambda: "--metrics-compat" in runtime_args(cluster), what="--metrics-compat on the pods")
        assert runtime_args(cluster)[runtime_args(cluster).index("--metrics-compat") + 1] == "vllm"
        service_ports = {p["name"]: p["port"] for p in cluster.service("chat")["spec"]["ports"]}
        assert service_ports == {"http": 9000, "grpc-ext-proc": 9002}

        # A spec change updates both objects in place.
        change_spec(cluster, {"port": 9100, "gateway": {
            "inferencePool": {"failureMode": "FailOpen"}, "httpRoute": {"hostnames": ["llm.example.com"]}}})
        updated = wait_for(lambda: (p := pool(cluster))["spec"]["targetPorts"] == [{"number": 9100}] and p,
                           what="the pool on the new port")
        assert updated["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
        assert updated["metadata"]["uid"] == created_pool["metadata"]["uid"]
        wait_for(lambda: route(cluster)["spec"].get("hostnames") == ["llm.example.com"], what="the hostnames")
        assert problems(pool(cluster)) == [] and problems(route(cluster)) == []

        # No parent any more: the route goes, the pool stays.
        change_spec(cluster, {"gateway": {"httpRoute": None}})
        wait_for(lambda: route(cluster) is None, what="the HTTPRoute to be deleted")
        assert pool(cluster) is not None

        # The pool off: it goes, and so do the flags and the port it needed.
        change_spec(cluster, {"gateway": {"inferencePool": {"enabled": False}}})
        wait_for(lambda: pool(cluster) is None, what="the InferencePool to be deleted")
        wait_for(lambda: "--metrics-compat" not in runtime_args(cluster), what="--metrics-compat to go")
        wait_for(lambda: [p["name"] for p in cluster.service("chat")["spec"]["ports"]] == ["http"],
                 what="the ext_proc port to go")
        (router,) = cluster.deployment("chat-router")["spec"]["template"]["spec"]["containers"]
        assert "--ext-proc-port" not in router["args"]
        # (each event is posted just after its delete)
        wait_for(lambda: {"HTTPRoute chat deleted", "InferencePool chat deleted"} <= {
            m.split(":")[0] for m in deleted_messages(cluster)}, what="the two Deleted events")


def objective(cluster, name):
    return cluster.get(OBJECTIVE, "inferenceobjectives", name)


def test_objectives_are_written_changed_and_pruned_as_the_spec_lists_them(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", router={"enabled": True}, gateway={
            "inferencePool": {"enabled": True},
            "objectives": [{"name": "interactive", "priority": 10}, {"name": "batch", "priority": -1}]}))
        made = wait_for(lambda: objective(cluster, "batch"), what="the InferenceObjectives")
        assert problems(made) == [] and made["spec"]["priority"] == -1
        assert objective(cluster, "interactive")["spec"]["poolRef"]["name"] == "chat"
        # batch leaves the list and interactive changes: one deleted, one updated
        change_spec(cluster, {"gateway": {"objectives": [{"name": "interactive", "priority": 5}]}})
        wait_for(lambda: objective(cluster, "batch") is None, what="batch to be deleted")
        wait_for(lambda: objective(cluster, "interactive")["spec"]["priority"] == 5,
                 what="interactive's new priority")
        wait_for(lambda: "interactive=5" in cluster.deployment("chat-router")["spec"]["template"]["spec"]
                 ["containers"][0]["args"], what="the router's --objective flag")
        wait_for(lambda: any("InferenceObjective batch deleted" in m for m in deleted_messages(cluster)),
                 what="batch's Deleted event")


def test_the_scaled_object_follows_the_spec_and_keda_scales_through_scale(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", autoscaling=KEDA))
        created = wait_for(lambda: scaled_object(cluster), what="the ScaledObject")
        assert problems(created) == []
        assert created["spec"]["scaleTargetRef"] == {"apiVersion": LLMD_API, "kind": "LLMDeployment",
                                                     "name": "chat"}
        assert (created["spec"]["minReplicaCount"], created["spec"]["maxReplicaCount"]) == (2, 6)

        change_spec(cluster, {"autoscaling": {"maxReplicas": 8, "targetQueueDepth": 6}})
        updated = wait_for(lambda: (o := scaled_object(cluster))["spec"]["maxReplicaCount"] == 8 and o,
                           what="the ScaledObject to follow maxReplicas")
        assert updated["spec"]["triggers"][0]["metadata"]["threshold"] == "6"
        assert problems(updated) == []

        # What KEDA's HPA does: set replicas through /scale. The Deployment follows.
        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"replicas": 5}}, sub="scale")
        wait_for(lambda: cluster.deployment("chat")["spec"]["replicas"] == 5, what="the Deployment to follow")

        change_spec(cluster, {"autoscaling": {"provider": "builtin"}})
        wait_for(lambda: scaled_object(cluster) is None, what="the ScaledObject to be deleted")


def scale_calls(cluster, name):
    return [(method, path) for method, path in cluster.operator_calls()
            if path.split("?")[0].endswith(f"/{names.PLURAL}/{name}/scale")]


def test_the_builtin_autoscaler_leaves_a_keda_scaled_object_alone(cluster):
    """Both objects' pods report 6x the target queue: the built-in one is scaled up, the KEDA
    one never sees a /scale call from the operator (neither read nor written)."""
    builtin_ip, keda_ip = "127.0.0.2", "127.0.0.3"
    port = free_port(builtin_ip, keda_ip)
    load = {"minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 2, "pollIntervalSeconds": 1}
    with contextlib.ExitStack() as stack:
        for ip in (builtin_ip, keda_ip):
            stack.enter_context(fixed_metrics_pod(ip, port, waiting=12, kv_usage=0.5))
        stack.enter_context(running_operator())
        cluster.create(llmdeployment("hot", port=port, replicas=1, autoscaling={"enabled": True, **load}))
        cluster.create(llmdeployment("chat", port=port, replicas=1, autoscaling={
            **KEDA, **load, "enabled": True}))
        stack.enter_context(DeploymentController(cluster, "hot", [builtin_ip]))
        keda_pods = stack.enter_context(DeploymentController(cluster, "chat", [keda_ip]))
        wait_for(lambda: keda_pods.pods(), what="the KEDA-scaled object's pod")
        wait_for(lambda: scaled_object(cluster), what="the ScaledObject")
        # The control: the same load scales the built-in one (its polls run every second).
        wait_for(lambda: cluster.llmd("hot")["spec"]["replicas"] == 3, timeout=30, what="the built-in scale-up")
        time.sleep(3)  # three more of its polls
        assert scale_calls(cluster, "hot")
        assert scale_calls(cluster, "chat") == []
        assert cluster.llmd("chat")["spec"]["replicas"] == 1
        assert not (cluster.llmd("chat").get("status") or {}).get("autoscaler")


def test_every_child_goes_when_its_switch_goes_off_with_the_operator_as_a_process(cluster, tmp_path):
    """Issue 49: the pool's switch off (its route's parentRefs still in the spec) and the
    autoscaler off: the InferencePool, its HTTPRoute and the ScaledObject are deleted within
    seconds, by `quire-operator` as it runs in a pod (its own process, leader election on)."""
    with operator_process(cluster, tmp_path):
        cluster.create(llmdeployment("chat", port=9000, router={"enabled": True}, autoscaling=KEDA, gateway={
            "inferencePool": {"enabled": True}, "httpRoute": {"parentRefs": [GATEWAY]}}))
        for get, what in ((pool, "the InferencePool"), (route, "the HTTPRoute"), (scaled_object, "the ScaledObject")):
            wait_for(lambda get=get: get(cluster), timeout=90, what=what)
        change_spec(cluster, {"gateway": {"inferencePool": {"enabled": False}}, "autoscaling": {"enabled": False}})
        for get, what in ((pool, "InferencePool"), (route, "HTTPRoute"), (scaled_object, "ScaledObject")):
            wait_for(lambda get=get: get(cluster) is None, timeout=15, what=f"the {what} to be deleted")
        log = (tmp_path / "operator.log").read_text()
        assert "InvalidSpec" not in log, log[-4000:]
