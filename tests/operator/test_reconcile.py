"""Create, update, resume, delete: the children and the status an LLMDeployment gets."""

import os
import time

import kubernetes

from quire_operator import names
from quire_operator.kube import Kube
from quire_operator.reconcile import reconcile

from operator_harness import LLMD_API, cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def condition(obj, kind):
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == kind), None)


def is_true(obj, kind):
    c = condition(obj, kind) if obj else None
    return c is not None and c["status"] == "True"


def test_create_makes_an_owned_deployment_and_service_with_the_served_pod(cluster):
    with running_operator():
        llmd = cluster.create(llmdeployment(
            "chat", model={"source": MODEL, "servedName": "smol"}, replicas=2, port=9000,
            resources={"gpus": 1, "cpu": "4", "memory": "16Gi"},
            runtime={"blockSize": 32, "maxNumSeqs": 64, "kvCacheDtype": "fp8_e4m3", "enablePrefixCaching": True,
                     "shutdownTimeoutSeconds": 60, "startupTimeoutSeconds": 900, "extraArgs": ["--log-requests"]},
            nodeSelector={"gpu": "a100"}, podAnnotations={"team": "search"}))
        dep = wait_for(lambda: cluster.deployment("chat"), what="the Deployment")
        svc = wait_for(lambda: cluster.service("chat"), what="the Service")

    uid = llmd["metadata"]["uid"]
    for child in (dep, svc):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": LLMD_API, "kind": "LLMDeployment", "name": "chat", "uid": uid,
                       "controller": True, "blockOwnerDeletion": True}

    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]
    # The pods are selected by a label that belongs to this LLMDeployment alone, and the Service
    # sends traffic to exactly those pods.
    assert dep["spec"]["selector"]["matchLabels"] == {names.SELECTOR_LABEL: "chat"}
    assert svc["spec"]["selector"] == {names.SELECTOR_LABEL: "chat"}
    assert pod["metadata"]["labels"][names.SELECTOR_LABEL] == "chat"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]

    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["quire"]
    assert container["args"] == [
        "serve", MODEL, "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "smol",
        "--block-size", "32", "--max-num-seqs", "64", "--kv-cache-dtype", "fp8_e4m3",
        "--shutdown-timeout", "60", "--enable-prefix-caching", "--log-requests"]
    assert container["image"] == "quire-test:latest"  # the operator's default (QUIRE_DEFAULT_IMAGE)
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                                      "limits": {"memory": "16Gi", "nvidia.com/gpu": 1}}
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]

    startup, ready, live = container["startupProbe"], container["readinessProbe"], container["livenessProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900  # the model-loading budget
    assert ready["httpGet"] == {"path": "/ready", "port": "http"}
    assert live["httpGet"] == {"path": "/health", "port": "http"}

    assert pod["spec"]["terminationGracePeriodSeconds"] > 60  # covers the server's drain
    assert pod["spec"]["nodeSelector"] == {"gpu": "a100"}
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "9000",
                                              "prometheus.io/path": "/metrics", "team": "search"}


def test_status_tells_the_truth_about_the_rollout(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", replicas=2))
        llmd = wait_for(lambda: (o := cluster.llmd("chat")) and (o.get("status") or {}).get("observedGeneration") and o,
                        what="generation 1 applied")
        assert condition(llmd, "Ready")["status"] == "False"
        assert is_true(llmd, "Progressing")
        assert condition(llmd, "Degraded")["status"] == "False"
        assert llmd["status"]["observedGeneration"] == 1
        assert llmd["status"]["endpoint"] == "http://chat.default.svc:8000"
        assert llmd["status"]["selector"] == f"{names.SELECTOR_LABEL}=chat"
        assert llmd["status"]["readyReplicas"] == 0

        cluster.mark_deployment_available("chat", ready=1)  # one of two pods is ready
        llmd = wait_for(lambda: (o := cluster.llmd("chat"))["status"].get("readyReplicas") == 1 and o)
        assert not is_true(llmd, "Ready")
        assert condition(llmd, "Ready")["message"] == "1/2 replicas ready"

        cluster.mark_deployment_available("chat")
        llmd = wait_for(lambda: (o := cluster.llmd("chat")) and is_true(o, "Ready") and o, what="Ready")
        assert llmd["status"]["replicas"] == 2 and llmd["status"]["readyReplicas"] == 2
        assert condition(llmd, "Progressing")["status"] == "False"
        for c in llmd["status"]["conditions"]:
            assert c["reason"] and c["message"] and c["lastTransitionTime"]


def test_a_spec_change_patches_the_deployment_and_advances_observed_generation(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", model={"source": MODEL}))
        wait_for(lambda: (cluster.llmd("chat").get("status") or {}).get("observedGeneration") == 1)
        cluster.mark_deployment_available("chat")
        wait_for(lambda: is_true(cluster.llmd("chat"), "Ready"), what="Ready")

        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"runtime": {"maxNumSeqs": 8}, "replicas": 3}})
        llmd = wait_for(lambda: (o := cluster.llmd("chat"))["status"].get("observedGeneration") == 2 and o,
                        what="observedGeneration 2")
        dep = cluster.deployment("chat")
        assert dep["spec"]["replicas"] == 3
        assert dep["spec"]["template"]["spec"]["containers"][0]["args"][-4:] == [
            "--max-num-seqs", "8", "--shutdown-timeout", "30"]
        assert dep["metadata"]["generation"] == 2
        # The Deployment controller has not caught up with the new pod template yet.
        assert not is_true(llmd, "Ready") and is_true(llmd, "Progressing")

        cluster.mark_deployment_available("chat")
        wait_for(lambda: is_true(cluster.llmd("chat"), "Ready"), what="Ready again")


def test_a_restart_with_nothing_changed_writes_nothing_and_duplicates_nothing(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", model={"source": MODEL}, podDisruptionBudget={"enabled": True}))
        wait_for(lambda: cluster.deployment("chat"))
        cluster.mark_deployment_available("chat")
        wait_for(lambda: is_true(cluster.llmd("chat"), "Ready"), what="Ready")
        time.sleep(0.5)  # let kopf finish its own bookkeeping
    writes_before = cluster.writes()
    calls_before = len(cluster.operator_calls())

    with running_operator() as runner:
        # The resumed reconcile ends by re-reading the LLMDeployment for its status check.
        status_read = f"GET /apis/{LLMD_API}/namespaces/default/{names.PLURAL}/chat"
        wait_for(lambda: any(f"{m} {p}" == status_read for m, p in cluster.operator_calls()[calls_before:]),
                 what="the resumed reconcile")
        time.sleep(1.0)
    assert "Resuming is processed: 1 succeeded" in runner.output
    assert cluster.writes() == writes_before
    assert len([w for w in cluster.writes() if w.startswith("POST /apis/apps/v1")]) == 1
    assert len(cluster.list("apps/v1", "deployments")) == 1


def test_deletion_leaves_nothing_behind(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", podDisruptionBudget={"enabled": True},
                                     autoscaling={"enabled": True, "maxReplicas": 2}))
        wait_for(lambda: cluster.get("policy/v1", "poddisruptionbudgets", "chat"), what="the PDB")
        wait_for(lambda: cluster.deployment("chat"), what="the Deployment")
        assert not cluster.llmd("chat")["metadata"].get("finalizers")  # nothing holds the deletion up
        cluster.delete(LLMD_API, names.PLURAL, "chat")
        wait_for(lambda: cluster.llmd("chat") is None, what="the LLMDeployment to go")
    assert cluster.deployment("chat") is None
    assert cluster.service("chat") is None
    assert cluster.get("policy/v1", "poddisruptionbudgets", "chat") is None


def test_a_deleted_deployment_is_put_back_and_an_unwanted_pdb_removed(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", podDisruptionBudget={"enabled": True, "maxUnavailable": 2}))
        first = wait_for(lambda: cluster.deployment("chat"))
        pdb = wait_for(lambda: cluster.get("policy/v1", "poddisruptionbudgets", "chat"), what="the PDB")
        assert pdb["spec"]["maxUnavailable"] == 2

        cluster.delete("apps/v1", "deployments", "chat")
        again = wait_for(lambda: (d := cluster.deployment("chat")) and d["metadata"]["uid"] != first["metadata"]["uid"]
                         and d, what="a new Deployment")
        assert again["spec"] == first["spec"]

        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"podDisruptionBudget": {"enabled": False}}})
        wait_for(lambda: cluster.get("policy/v1", "poddisruptionbudgets", "chat") is None, what="the PDB to go")


def test_a_handlers_older_body_leaves_a_newer_applied_spec_alone(cluster):
    """kopf hands a handler the body of the event it processes, while a child's event or the
    resync (which read the LLMDeployment afresh) may already have applied a newer spec. Applying
    the older body would roll the pods back to it, and forward again on the next event: two
    rolls for one edit, and observedGeneration set back. Here the handler of the edit before
    `pvc://` runs after the edit's own reconcile."""
    kube = Kube(kubernetes.config.new_client_from_config(config_file=os.environ["KUBECONFIG"]))
    quiet = lambda *_: None  # noqa: E731 (no Events needed)
    sql = {"name": "sql", "source": "/mnt/loras/sql"}
    cluster.create(llmdeployment("chat", adapters=[sql]))
    older = cluster.llmd("chat")
    reconcile(kube, older, "quire-test:latest", quiet)
    cluster.patch(LLMD_API, names.PLURAL, "chat",
                  {"spec": {"adapters": [sql, {"name": "b", "source": "pvc://loras/b"}]}})
    newer = cluster.llmd("chat")
    reconcile(kube, newer, "quire-test:latest", quiet)
    mounted = cluster.deployment("chat")
    claims = [v.get("persistentVolumeClaim") for v in mounted["spec"]["template"]["spec"]["volumes"]]
    assert {"claimName": "loras", "readOnly": True} in claims

    reconcile(kube, older, "quire-test:latest", quiet)  # the late handler
    assert cluster.deployment("chat")["metadata"] == mounted["metadata"]  # not written again
    assert cluster.llmd("chat")["status"]["observedGeneration"] == newer["metadata"]["generation"]
