"""Deleting an LLMDeployment never waits for the operator (issue 13, item 5): the operator adds
no finalizer (garbage collection removes the children through their ownerReferences), and it
removes the one older versions added."""

from quire_operator import names

from operator_harness import LLMD_API, cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)


def test_deleting_with_the_operator_stopped_works(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", podDisruptionBudget={"enabled": True},
                                     autoscaling={"enabled": True, "maxReplicas": 2, "pollIntervalSeconds": 1}))
        wait_for(lambda: cluster.get("policy/v1", "poddisruptionbudgets", "chat"), what="the PDB")
        wait_for(lambda: ((cluster.llmd("chat").get("status") or {}).get("autoscaler") or {}).get("reason"),
                 what="the autoscaler at work")
    # The operator is stopped (or uninstalled).
    assert not cluster.llmd("chat")["metadata"].get("finalizers")
    cluster.delete(LLMD_API, names.PLURAL, "chat")
    assert cluster.llmd("chat") is None
    assert cluster.deployment("chat") is None and cluster.service("chat") is None
    assert cluster.get("policy/v1", "poddisruptionbudgets", "chat") is None


def test_the_finalizer_of_older_versions_is_removed(cluster):
    llmd = llmdeployment("chat", autoscaling={"enabled": True, "maxReplicas": 2})
    llmd["metadata"]["finalizers"] = [names.LEGACY_FINALIZER]
    cluster.create(llmd)
    with running_operator():
        wait_for(lambda: not cluster.llmd("chat")["metadata"].get("finalizers"), what="the finalizer removed")
        wait_for(lambda: cluster.deployment("chat"), what="the Deployment")
    cluster.delete(LLMD_API, names.PLURAL, "chat")
    assert cluster.llmd("chat") is None
