"""/scale, as `kubectl scale`, HPA or KEDA use it, reads and writes the replica count."""

from quire_operator import names

from operator_harness import LLMD_API, cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)


def test_scale_reads_and_writes_replicas(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", replicas=2))
        wait_for(lambda: cluster.deployment("chat"))
        cluster.mark_deployment_available("chat")
        wait_for(lambda: (cluster.llmd("chat").get("status") or {}).get("readyReplicas") == 2)

        scale = cluster.get(LLMD_API, names.PLURAL, "chat", sub="scale")
        assert scale["kind"] == "Scale"
        assert scale["spec"] == {"replicas": 2}
        assert scale["status"] == {"replicas": 2, "selector": f"{names.SELECTOR_LABEL}=chat"}

        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"replicas": 5}}, sub="scale")
        assert cluster.llmd("chat")["spec"]["replicas"] == 5
        wait_for(lambda: cluster.deployment("chat")["spec"]["replicas"] == 5, what="the Deployment to follow")
        assert cluster.get(LLMD_API, names.PLURAL, "chat", sub="scale")["spec"] == {"replicas": 5}
