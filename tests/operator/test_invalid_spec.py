"""Specs the schema lets through but the operator refuses: Degraded, a Warning Event, nothing else."""

import time

from quire_operator import names

from operator_harness import LLMD_API, cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)

INVALID = {
    "min-over-max": ({"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 2}},
                     "spec.autoscaling.minReplicas: 4 is greater than maxReplicas 2"),
    "kv-dtype": ({"runtime": {"kvCacheDtype": "int3"}},
                 "spec.runtime.kvCacheDtype: 'int3' is not one of auto, fp8_e4m3, fp8_e5m2"),
    "source": ({"model": {"source": "weights.gguf"}}, "spec.model.source: 'weights.gguf' names no file"),
    "block-size": ({"runtime": {"blockSize": 24}}, "spec.runtime.blockSize: 24 is not a power of two"),
    "gpus-vs-tensor": ({"parallelism": {"tensor": 2}, "resources": {"gpus": 1}},
                       "spec.resources.gpus: 1 does not match spec.parallelism.tensor 2"),
    "adapter-source": ({"adapters": [{"name": "sql", "source": "oci://registry/sql:1"}]},
                       "spec.adapters[0].source: 'oci://registry/sql:1': oci:// sources are not supported yet"),
}


def degraded(obj):
    return next((c for c in (obj.get("status") or {}).get("conditions", [])
                 if c["type"] == "Degraded" and c["status"] == "True"), None)


def test_invalid_specs_are_reported_and_create_nothing(cluster):
    with running_operator():
        for name, (spec, _) in INVALID.items():
            cluster.create(llmdeployment(name, **spec))
        for name, (_, message) in INVALID.items():
            cond = wait_for(lambda: degraded(cluster.llmd(name)), what=f"{name} Degraded")
            assert cond["reason"] == "InvalidSpec"
            assert cond["message"].startswith(message)
            events = wait_for(lambda: [e for e in cluster.events(name) if e["type"] == "Warning"])
            assert events[0]["reason"] == "InvalidSpec" and events[0]["message"].startswith(message)
            assert cluster.deployment(name) is None and cluster.service(name) is None
            assert "observedGeneration" not in cluster.llmd(name)["status"]

        # No retry storm: an invalid spec is not retried until it changes.
        calls = len(cluster.operator_calls())
        time.sleep(1.5)
        later = [c for c in cluster.operator_calls()[calls:] if not c[1].endswith("watch=true") and "watch=" not in c[1]]
        assert later == []

        # Fixing the spec clears the condition and creates the children.
        cluster.patch(LLMD_API, names.PLURAL, "kv-dtype", {"spec": {"runtime": {"kvCacheDtype": "fp8_e5m2"}}})
        wait_for(lambda: cluster.deployment("kv-dtype"), what="the Deployment")
        llmd = wait_for(lambda: (o := cluster.llmd("kv-dtype"))["status"].get("observedGeneration") == 2 and o)
        assert not degraded(llmd)


def test_a_bad_edit_leaves_the_running_deployment_alone(cluster):
    with running_operator():
        cluster.create(llmdeployment("chat", runtime={"blockSize": 16}))
        dep = wait_for(lambda: cluster.deployment("chat"))
        wait_for(lambda: (cluster.llmd("chat").get("status") or {}).get("observedGeneration") == 1)
        before = cluster.mark_deployment_available("chat")
        wait_for(lambda: (cluster.llmd("chat").get("status") or {}).get("readyReplicas") == 1)

        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"runtime": {"blockSize": 12}}})
        llmd = wait_for(lambda: (o := cluster.llmd("chat")) and degraded(o) and o, what="Degraded")
        assert llmd["status"]["observedGeneration"] == 1  # generation 2 was not applied
        ready = next(c for c in llmd["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True"  # the old pods still serve
        after = cluster.deployment("chat")
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
        assert after["spec"] == dep["spec"]
