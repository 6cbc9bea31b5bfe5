"""Multi-node replicas (issue 45): spec.parallelism.pipeline > 1 runs as a LeaderWorkerSet (LWS
v0.7, vendored CRD), one group of `pipeline` pods per replica, whose leaders alone serve; 1 stays
a Deployment. Switching either way leaves one set of serving pods; bad values are refused at
admission, naming the field."""

import copy

import crd_rules
import pytest
from foreign_crds import CRDS, api_version, problems

from quire_operator import handlers, names, status
from quire_operator.children import desired_deployment, desired_service
from quire_operator.drift import drift_of, patch_for
from quire_operator.gateway_children import desired_inference_pool
from quire_operator.lws_children import desired_leaderworkerset
from quire_operator.network_policy import PolicySettings, desired_network_policies
from quire_operator.router_children import desired_headless_service
from quire_operator.spec import SpecError, parse_spec

from operator_harness import (  # noqa: F401 (cluster is a fixture)
    LLMD_API,
    cluster,
    crd_object,
    llmdeployment,
    running_operator,
    wait_for,
)

OWNER = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "big", "namespace": "default", "uid": "u"}}
LWS = api_version("LeaderWorkerSet")
MULTI = {"parallelism": {"tensor": 8, "pipeline": 2}}
LEADERS = {names.SELECTOR_LABEL: "big", names.LWS_WORKER_INDEX_LABEL: "0"}


def lws_of(spec: dict) -> dict:
    return desired_leaderworkerset(OWNER, parse_spec(spec), "img")


def containers(lws: dict) -> tuple[dict, dict]:
    template = lws["spec"]["leaderWorkerTemplate"]
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    return leader, worker


# --- the object ---

@pytest.mark.parametrize("spec", [
    MULTI,
    {"parallelism": {"tensor": 1, "pipeline": 4}, "replicas": 3, "resources": {"memory": "64Gi", "cpu": "8"}},
    {**MULTI, "model": {"source": "meta-llama/Llama-3.1-405B-Instruct", "pvc": {"claimName": "models"}},
     "tls": {"secretName": "serving-tls"}, "router": {"enabled": True},
     "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
     "env": [{"name": "NCCL_DEBUG", "value": "INFO"}], "runtime": {"maxModelLen": 8192}},
])
def test_the_leaderworkerset_is_valid_for_the_vendored_lws_crd(spec):
    assert problems(lws_of(spec)) == []


def test_the_groups_step_channel_key_comes_from_the_named_secret():
    """Leader and workers read the same key; without keySecret neither gets one (the runtime
    then warns that it uses its built-in key), and single-node pods never do."""
    keyed = lws_of({**MULTI, "parallelism": {**MULTI["parallelism"],
                                             "keySecret": {"name": "group-key"}}})
    assert problems(keyed) == []
    ref = {"name": "QUIRE_DISTRIBUTED_KEY",
           "valueFrom": {"secretKeyRef": {"name": "group-key", "key": "distributed-key"}}}
    for container in containers(keyed):
        assert ref in container["env"]
    for container in containers(lws_of(MULTI)):
        assert all(e["name"] != "QUIRE_DISTRIBUTED_KEY" for e in container["env"])
    single = desired_deployment(OWNER, parse_spec({"parallelism": {"keySecret": {"name": "k"}}}),
                                "img")
    (container,) = single["spec"]["template"]["spec"]["containers"]
    assert all(e["name"] != "QUIRE_DISTRIBUTED_KEY" for e in container.get("env", []))


def test_a_group_is_one_replica_of_pipeline_pods_that_restart_together():
    lws = lws_of({**MULTI, "replicas": 3})
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert lws["spec"]["replicas"] == 3
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    # Workers must start before the leader can be ready (it loads its stage only with them).
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    # Each group's headless Service is <name>-<group>, never <name>: that is the client
    # Service's name, and LWS's Shared policy would want it for its own (the leader's address
    # would not resolve, or the operator would take LWS's headless Service over).
    assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    (ref,) = lws["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("LLMDeployment", "big", "u", True)


def test_the_leader_serves_as_stage_zero_and_the_workers_join_it_headless():
    leader, worker = containers(lws_of({**MULTI, "runtime": {"dtype": "bfloat16"}}))
    stage = ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", "--nnodes", "2"]
    rendezvous = ["--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", "29500"]
    assert leader["args"][:5] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert leader["args"][-12:] == [*stage, "--node-rank", "0", *rendezvous]
    assert leader["args"].count("--tensor-parallel-size") == 1
    assert worker["args"] == ["serve", "--dtype", "bfloat16", "--shutdown-timeout", "30", *stage,
                              "--node-rank", "$(LWS_WORKER_INDEX)", *rendezvous, "--headless"]
    assert {p["containerPort"] for p in leader["ports"]} == {8000, 29500, 29501}
    # A headless worker serves no API: no port, no HTTP probe, nothing to scrape.
    assert "ports" not in worker and not {"readinessProbe", "livenessProbe", "startupProbe"} & set(worker)
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert worker["resources"] == leader["resources"] == {"limits": {"nvidia.com/gpu": 8}}


def test_both_pods_come_from_the_single_node_pod_template():
    lws = lws_of({**MULTI, "model": {"source": "org/big", "pvc": {"claimName": "models"}},
                  "tls": {"secretName": "serving-tls"}})
    template = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    single = desired_deployment(OWNER, parse_spec({"parallelism": {"tensor": 8}, "model": {
        "source": "org/big", "pvc": {"claimName": "models"}}, "tls": {"secretName": "serving-tls"}}),
        "img")["spec"]["template"]
    assert leader["spec"]["securityContext"] == worker["spec"]["securityContext"] == single["spec"]["securityContext"]
    assert leader["spec"]["volumes"] == single["spec"]["volumes"]
    # The worker reads the same model volume, but the API's TLS Secret is the leader's only.
    assert {v["name"] for v in worker["spec"]["volumes"]} == {v["name"] for v in single["spec"]["volumes"]} - {"tls"}
    assert worker["metadata"]["labels"][names.SELECTOR_LABEL] == "big"
    assert "prometheus.io/scrape" not in (worker["metadata"].get("annotations") or {})


def test_single_node_specs_stay_deployments_with_their_old_args():
    spec = parse_spec({"parallelism": {"tensor": 2}})
    assert desired_leaderworkerset(OWNER, spec, "img") is None
    args = desired_deployment(OWNER, spec, "img")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2" and "--pipeline-parallel-size" not in args
    assert desired_service(OWNER, spec)["spec"]["selector"] == {names.SELECTOR_LABEL: "big"}


def test_the_services_the_router_and_the_pool_select_leaders_only():
    spec = parse_spec({**MULTI, "router": {"enabled": True}, "gateway": {"inferencePool": {"enabled": True}}})
    assert desired_service(OWNER, spec)["spec"]["selector"] == LEADERS
    assert desired_headless_service(OWNER, spec.router)["spec"]["selector"] == LEADERS
    assert desired_inference_pool(OWNER, spec)["spec"]["selector"]["matchLabels"] == LEADERS
    assert names.selector_string("big", leaders_only=True) == \
        "leaderworkerset.sigs.k8s.io/worker-index=0,quire.dev/llmdeployment=big"


def test_back_to_single_node_the_pool_loses_the_leader_key():
    live = desired_inference_pool(OWNER, parse_spec({**MULTI, "router": {"enabled": True},
                                                     "gateway": {"inferencePool": {"enabled": True}}}))
    desired = desired_inference_pool(OWNER, parse_spec({"router": {"enabled": True},
                                                        "gateway": {"inferencePool": {"enabled": True}}}))
    assert drift_of(live, desired) is not None
    assert patch_for(live, desired)["spec"]["selector"]["matchLabels"][names.LWS_WORKER_INDEX_LABEL] is None


def test_the_autoscaler_and_adapter_sync_see_leaders_only():
    def indexed(worker_index):
        labels = {names.SELECTOR_LABEL: "big"}
        if worker_index is not None:
            labels[names.LWS_WORKER_INDEX_LABEL] = worker_index
        return handlers.pods_by_llmdeployment(namespace="default", name="big-0", labels=labels, meta={},
                                              spec={}, status={"podIP": "10.0.0.1"})
    assert indexed(None) and indexed("0")  # a Deployment's pod, a group's leader
    assert indexed("1") == {}  # a worker: no /metrics, no API


def test_network_policy_lets_a_group_talk_among_itself():
    settings = PolicySettings(allowed_clients=(), operator_namespace="quire", operator_labels={"app": "op"})
    (single,) = desired_network_policies(OWNER, parse_spec({}), settings)
    (multi,) = desired_network_policies(OWNER, parse_spec(MULTI), settings)
    assert multi["spec"]["ingress"][:-1] == single["spec"]["ingress"]
    assert multi["spec"]["ingress"][-1] == {"from": [{"podSelector": {"matchLabels": {names.SELECTOR_LABEL: "big"}}}]}


def test_status_reads_the_groups_of_the_leaderworkerset():
    lws = {"kind": "LeaderWorkerSet", "metadata": {"generation": 2}, "spec": {"replicas": 2},
           "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}}
    ready, progressing, _ = status.conditions(lws, None, "LeaderWorkerSet")
    assert (ready["status"], ready["message"]) == ("False", "1/2 replicas ready")
    lws["status"]["readyReplicas"] = 2
    ready, progressing, degraded = status.conditions(lws, None, "LeaderWorkerSet")
    assert (ready["status"], progressing["reason"], degraded["status"]) == ("True", "RolloutComplete", "False")
    lws["status"]["conditions"] = [{"type": "UpdateInProgress", "status": "True"}]
    assert status.conditions(lws, None, "LeaderWorkerSet")[1]["reason"] == "RollingOut"
    missing = status.conditions(None, None, "LeaderWorkerSet")[0]
    assert (missing["reason"], missing["message"]) == ("NoLeaderWorkerSet", "the LeaderWorkerSet does not exist")


# --- admission ---

def admitted(spec: dict) -> list[str]:
    return crd_rules.violations({"apiVersion": LLMD_API, "kind": "LLMDeployment", "metadata": {"name": "big"},
                                 "spec": spec}, crd_object())


@pytest.mark.parametrize("pipeline", [0, -1, 65, "two", 1.5, True])
def test_a_bad_pipeline_is_refused_at_admission_and_by_the_operator(pipeline):
    found = admitted({"parallelism": {"pipeline": pipeline}})
    assert found and "parallelism.pipeline" in found[0], found
    with pytest.raises(SpecError) as refused:
        parse_spec({"parallelism": {"pipeline": pipeline}})
    assert "spec.parallelism.pipeline" in str(refused.value)


def test_the_crd_defaults_pipeline_to_one_and_takes_up_to_64():
    schema = crd_rules.schema_of(crd_object())["properties"]["spec"]["properties"]["parallelism"]["properties"]
    assert (schema["pipeline"]["default"], schema["pipeline"]["minimum"], schema["pipeline"]["maximum"]) == (1, 1, 64)
    assert admitted({"parallelism": {"pipeline": 64, "tensor": 16}}) == []


def test_lora_with_several_nodes_is_refused_at_admission_and_by_the_operator():
    spec = {**MULTI, "lora": {"maxLoras": 2}}
    assert admitted(spec) == ["lora and adapters are not supported with parallelism.pipeline > 1 yet"]
    with pytest.raises(SpecError, match="spec.lora"):
        parse_spec(spec)


@pytest.mark.parametrize("flag", ["--pipeline-parallel-size=2", "--node-rank", "--headless", "--master-addr"])
def test_the_group_flags_are_the_operators(flag):
    with pytest.raises(SpecError, match="extraArgs"):
        parse_spec({**MULTI, "runtime": {"extraArgs": [flag]}})


def test_the_vendored_crd_refuses_what_lws_would():
    lws = lws_of(MULTI)
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    assert "restartPolicy" in problems(bad)[0]
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["gpus"] = 8
    assert problems(bad) == ["spec.leaderWorkerTemplate.workerTemplate.spec.containers[0].gpus: unknown field "
                             "(the API server would prune it)"]
    assert CRDS["LeaderWorkerSet"]["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


# --- the running operator ---

def lws(cluster, name="chat"):
    return cluster.get(LWS, "leaderworkersets", name)


def condition(obj, kind):
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == kind), None)


def test_the_operator_writes_an_owned_lws_that_follows_replicas_and_repairs_drift(cluster):
    with running_operator():
        llmd = cluster.create(llmdeployment("chat", replicas=2, **MULTI))
        made = wait_for(lambda: lws(cluster), what="the LeaderWorkerSet")
        assert problems(made) == []
        (ref,) = made["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"]) == ("LLMDeployment", llmd["metadata"]["uid"])
        assert made["spec"]["replicas"] == 2 and cluster.deployment("chat") is None
        # the Service follows the workload in the same pass
        wait_for(lambda: (cluster.service("chat") or {}).get("spec", {}).get("selector")
                 == {names.SELECTOR_LABEL: "chat", names.LWS_WORKER_INDEX_LABEL: "0"},
                 what="the Service selecting leaders")

        # kubectl scale llmd chat --replicas 3: three groups.
        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"replicas": 3}})
        wait_for(lambda: lws(cluster)["spec"]["replicas"] == 3, what="3 groups")

        # Someone shrinks the groups by hand: the watch event puts the spec back.
        cluster.patch(LWS, "leaderworkersets", "chat", {"spec": {"leaderWorkerTemplate": {"size": 5}}})
        wait_for(lambda: lws(cluster)["spec"]["leaderWorkerTemplate"]["size"] == 2, what="the size restored")
        # (the event is posted just after the write that restores it)
        wait_for(lambda: any(e["reason"] == "DriftCorrected" for e in cluster.events("chat")),
                 what="the DriftCorrected event")

        # The LWS controller reports its groups: the LLMDeployment's status follows.
        cluster.patch(LWS, "leaderworkersets", "chat", {"status": {
            "replicas": 3, "readyReplicas": 3, "updatedReplicas": 3,
            "conditions": [{"type": "Available", "status": "True", "reason": "AllGroupsReady", "message": "",
                            "lastTransitionTime": "2025-08-05T00:00:00Z"}]}}, sub="status")
        ready = wait_for(lambda: (c := condition(cluster.llmd("chat"), "Ready")) and c["status"] == "True" and c,
                         what="Ready")
        assert ready["message"] == "3/3 replicas ready"
        st = cluster.llmd("chat")["status"]
        assert (st["replicas"], st["readyReplicas"]) == (3, 3)
        assert st["selector"] == "leaderworkerset.sigs.k8s.io/worker-index=0,quire.dev/llmdeployment=chat"


def test_switching_nodes_replaces_the_workload_and_never_keeps_two(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", parallelism={"tensor": 8}))
        wait_for(lambda: cluster.deployment("chat"), what="the Deployment")

        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"parallelism": {"pipeline": 2}}})
        wait_for(lambda: lws(cluster) and cluster.deployment("chat") is None, what="the LWS in its place")
        # the Services follow the workload in the same pass
        wait_for(lambda: names.LWS_WORKER_INDEX_LABEL in cluster.service("chat")["spec"]["selector"],
                 what="the Service selecting leaders")

        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"parallelism": {"pipeline": 1}}})
        wait_for(lambda: cluster.deployment("chat") and lws(cluster) is None, what="the Deployment back")
        wait_for(lambda: cluster.service("chat")["spec"]["selector"] == {names.SELECTOR_LABEL: "chat"},
                 what="the Service selecting every pod again")
        # (each event is posted just after its delete)
        wait_for(lambda: all(any(e["reason"] == "Deleted" and e["message"].startswith(kind + " chat deleted")
                                 for e in cluster.events("chat")) for kind in ("Deployment", "LeaderWorkerSet")),
                 what="the two Deleted events")


def uninstall_lws(cluster):
    """The LWS CRD is not installed: discovery does not list the kind, and writes of it answer
    404 as the API server's do for an unknown resource."""
    def forget(emulator):
        for key in [k for k in emulator.resources if k.plural == "leaderworkersets"]:
            del emulator.resources[key]
        emulator.add_validation("leaderworkersets", lambda obj: "the server could not find the requested resource",
                                code=404)
    cluster.running.call(forget)


def test_without_lws_installed_single_node_works_and_multi_node_says_why(cluster):
    uninstall_lws(cluster)
    with running_operator():
        cluster.create(llmdeployment("chat"))
        wait_for(lambda: cluster.deployment("chat"), what="the Deployment")
        cluster.create(llmdeployment("big", **MULTI))
        degraded = wait_for(lambda: (c := condition(cluster.llmd("big") or {}, "Degraded"))
                            and c["status"] == "True" and c, what="Degraded")
        assert degraded["reason"] == "Rejected"
        assert "is the LeaderWorkerSet controller (kubernetes-sigs/lws v0.7 or later) installed?" in degraded["message"]
        # A switch the cluster cannot take leaves the Deployment serving.
        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"parallelism": {"pipeline": 2}}})
        wait_for(lambda: (c := condition(cluster.llmd("chat"), "Degraded")) and c["status"] == "True",
                 what="chat Degraded")
        assert cluster.deployment("chat") is not None
