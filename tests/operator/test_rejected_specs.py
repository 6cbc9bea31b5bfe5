"""Specs the API server would reject never wedge the resource (issue 13, item 1).

What the operator can check, it checks before any write (quantities, the names its children
take); what only the API server knows (a 4xx on a child) is permanent: Ready=False,
Degraded=True with the server's message, one Warning Event, and no retrying until the spec
changes."""

import time

import pytest

from quire_operator import names
from quire_operator.reconcile import check_child_names, check_ports
from quire_operator.spec import SpecError, parse_spec

from operator_harness import LLMD_API, cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)

NOT_QUANTITY = "is not a Kubernetes quantity"
REFUSED = {
    "memory-16gb": ({"resources": {"memory": "16GB"}}, f"spec.resources.memory: '16GB' {NOT_QUANTITY}"),
    "cpu-two": ({"resources": {"cpu": "two"}}, f"spec.resources.cpu: 'two' {NOT_QUANTITY}"),
    "chat.v2": ({}, "metadata.name: 'chat.v2' is not a valid Service name (DNS-1035"),
    "x" * 64: ({}, f"metadata.name: '{'x' * 64}' is 64 characters; at most 63"),
    # 60 characters fit alone, not with the router's <name>-router and <name>-pods
    "r" * 60: ({"router": {"enabled": True}},
               f"metadata.name: '{'r' * 60}' is 60 characters, so this spec's child "
               f"'{'r' * 60}-router' would be 67"),
}


def condition(obj, kind):
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == kind), None)


def settled_calls(cluster, since):
    """The operator's calls after `since`, without its long-running watches."""
    return [c for c in cluster.operator_calls()[since:] if "watch=" not in c[1]]


def test_specs_the_api_server_would_reject_are_refused_before_any_write(cluster):
    with running_operator():
        for name, (spec, _) in REFUSED.items():
            cluster.create(llmdeployment(name, **spec))
        for name, (_, message) in REFUSED.items():
            degraded = wait_for(lambda name=name: (o := cluster.llmd(name)) and (c := condition(o, "Degraded"))
                                and c["status"] == "True" and c, what=f"{name} Degraded")
            assert degraded["reason"] == "InvalidSpec" and degraded["message"].startswith(message)
            ready = condition(cluster.llmd(name), "Ready")
            assert ready["status"] == "False" and ready["message"].startswith(message)
            warnings = wait_for(lambda name=name: [e for e in cluster.events(name) if e["type"] == "Warning"])
            assert [e["reason"] for e in warnings] == ["InvalidSpec"]
            assert warnings[0]["message"].startswith(message)
        # Nothing was written for any of them but their status and their Event.
        assert [w for w in cluster.writes() if not w.endswith("/status") and "/events" not in w
                and f"/{names.PLURAL}/" not in w] == []
        calls = len(cluster.operator_calls())
        time.sleep(2)  # no retries: nothing happens until the spec changes
        assert settled_calls(cluster, calls) == []


def _reject_bad_toleration_effects(deployment):
    """The API server's own check of a pod template, which the emulator does not make by itself."""
    for t in deployment["spec"]["template"]["spec"].get("tolerations") or []:
        if t.get("effect") not in (None, "NoSchedule", "PreferNoSchedule", "NoExecute"):
            return (f'spec.template.spec.tolerations[0].effect: Unsupported value: "{t["effect"]}": supported '
                    'values: "NoExecute", "NoSchedule", "PreferNoSchedule"')
    return None


def test_a_child_the_api_server_rejects_is_reported_once_and_not_retried(cluster):
    cluster.running.call(lambda e: e.add_validation("deployments", _reject_bad_toleration_effects))
    with running_operator():
        cluster.create(llmdeployment("chat", tolerations=[{"key": "gpu", "operator": "Exists", "effect": "Sometimes"}]))
        degraded = wait_for(lambda: (c := condition(cluster.llmd("chat") or {}, "Degraded")) and c["status"] == "True"
                            and c, what="Degraded")
        assert degraded["reason"] == "Rejected"
        assert 'the API server rejected the Deployment \'chat\': 422 Invalid: Deployment "chat" is invalid: ' \
               'spec.template.spec.tolerations[0].effect: Unsupported value: "Sometimes"' in degraded["message"]
        ready = condition(cluster.llmd("chat"), "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "Rejected") and "Unsupported value" in ready["message"]
        warnings = wait_for(lambda: [e for e in cluster.events("chat") if e["type"] == "Warning"])
        assert [e["reason"] for e in warnings] == ["Rejected"] and "Unsupported value" in warnings[0]["message"]

        # No hot retry loop: neither kopf's retries nor the watches try again.
        calls = len(cluster.operator_calls())
        time.sleep(2)
        assert settled_calls(cluster, calls) == []
        assert len([e for e in cluster.events("chat") if e["type"] == "Warning"]) == 1
        assert cluster.deployment("chat") is None

        # A fixed spec applies at once and clears the condition.
        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"tolerations": [
            {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}})
        wait_for(lambda: cluster.deployment("chat"), what="the Deployment")
        llmd = wait_for(lambda: (o := cluster.llmd("chat"))["status"].get("observedGeneration") == 2 and o)
        assert condition(llmd, "Degraded")["status"] == "False"


def test_a_rejected_update_leaves_the_serving_pods_alone(cluster):
    cluster.running.call(lambda e: e.add_validation("deployments", _reject_bad_toleration_effects))
    with running_operator():
        cluster.create(llmdeployment("chat"))
        wait_for(lambda: (cluster.llmd("chat").get("status") or {}).get("observedGeneration") == 1)
        before = cluster.mark_deployment_available("chat")
        wait_for(lambda: (c := condition(cluster.llmd("chat"), "Ready")) and c["status"] == "True", what="Ready")

        cluster.patch(LLMD_API, names.PLURAL, "chat", {"spec": {"tolerations": [{"key": "x", "effect": "Never"}]}})
        degraded = wait_for(lambda: (c := condition(cluster.llmd("chat"), "Degraded")) and c["status"] == "True"
                            and c, what="Degraded")
        assert degraded["reason"] == "Rejected"
        llmd = cluster.llmd("chat")
        assert llmd["status"]["observedGeneration"] == 1  # generation 2 is not applied
        assert condition(llmd, "Ready")["status"] == "True"  # the old pods still serve
        assert cluster.deployment("chat")["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


def test_the_names_of_every_childs_suffix_are_counted():
    """Each spec's longest child: the router's, the Valkey pod's, a group's worker pod (its
    host name, and its group's Service <name>-<group>)."""
    cases = [({"kvCache": {"offload": {"remote": {"valkey": {"memory": "2Gi"}}}}}, "-kv-0"),
             ({"parallelism": {"tensor": 8, "pipeline": 2}, "replicas": 12}, "-11-1"),
             ({"parallelism": {"tensor": 8, "pipeline": 2}, "replicas": 1,
               "autoscaling": {"enabled": True, "maxReplicas": 100}}, "-99-1")]
    for spec, suffix in cases:
        fits = "n" * (63 - len(suffix))
        check_child_names(fits, parse_spec(spec))
        with pytest.raises(SpecError, match=f"'{fits}n{suffix}' would be 64"):
            check_child_names(fits + "n", parse_spec(spec))
    check_child_names("n" * 63, parse_spec({}))  # a plain spec: its children take the name



def test_a_port_that_a_fixed_port_shares_an_object_with_is_refused():
    """The Service with the endpoint picker's 9002 or the KV events' 5557, the leader with its
    rendezvous 29500 and control 29501: one port twice is a body the API server refuses."""
    router = {"router": {"enabled": True}}
    for spec, port in [({**router, "gateway": {"inferencePool": {"enabled": True}}}, 9002),
                       ({"router": {"enabled": True, "routing": "precise-prefix"}}, 5557),
                       ({"parallelism": {"tensor": 8, "pipeline": 2}}, 29500),
                       ({"parallelism": {"tensor": 8, "pipeline": 2}}, 29501)]:
        check_ports(parse_spec(spec))  # the default port: fine
        with pytest.raises(SpecError, match=f"spec.port: {port} is .* too; choose another"):
            check_ports(parse_spec({**spec, "port": port}))
    check_ports(parse_spec({"port": 9002}))  # nothing else on 9002 without the pool
