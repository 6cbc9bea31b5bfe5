"""Every pod the chart renders passes the "restricted" Pod Security Standard (the checker in
restricted_profile.py), and the checker itself rejects pods that break each rule (issue 36)."""

import copy
import re

import pytest

from chart_render import render
from restricted_profile import assert_restricted, pod_spec_of, violations

VALUE_SETS = {
    "defaults": {},
    "single-namespace": {"watch": {"clusterWide": False, "namespaces": ["llm-a", "llm-b"]}},
    "one-replica-without-leader-election": {"replicaCount": 1, "leaderElection": {"enabled": False}},
    "network-policy": {"networkPolicy": {"enabled": True}},
    "custom-resources-and-placement": {
        "resources": {"requests": {"cpu": "200m"}, "limits": {"memory": "512Mi"}},
        "nodeSelector": {"kubernetes.io/os": "linux"}, "podLabels": {"team": "ml"}},
}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_pod_passes_the_restricted_profile(name):
    workloads = [o for o in render(VALUE_SETS[name]) if pod_spec_of(o) is not None]
    assert workloads  # the operator's Deployment at least
    for obj in workloads:
        assert_restricted(obj)


def test_the_operator_pod_writes_only_to_its_tmp_volume():
    (deployment,) = [o for o in render() if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == "/tmp"
    assert {"name": mount["name"], "emptyDir": {}} in pod["volumes"]


GOOD_POD = {
    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                        "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{"name": "app", "image": "x", "securityContext": {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True}}],
    "volumes": [{"name": "tmp", "emptyDir": {}}],
}


def _set(path: str, value):
    def change(pod):
        *parents, last = path.split(".")
        target = pod
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target.setdefault(key, {})
        if value is None:
            del target[last]
        else:
            target[last] = value
    return change


# Each breaks one rule; the checker must name that rule.
BAD_PODS = {
    "Host Namespaces": _set("hostNetwork", True),
    "Privileged Containers": _set("containers.0.securityContext.privileged", True),
    "Volume Types": lambda pod: pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
    "Privilege Escalation": _set("containers.0.securityContext.allowPrivilegeEscalation", None),
    "Running as Non-root:": _set("securityContext.runAsNonRoot", False),
    "Running as Non-root user": _set("containers.0.securityContext.runAsUser", 0),
    "Seccomp: no seccompProfile": _set("securityContext.seccompProfile", None),
    "Seccomp: containers[app] sets": _set("containers.0.securityContext.seccompProfile",
                                          {"type": "Unconfined"}),
    "Capabilities: containers[app] does not drop ALL": _set(
        "containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]}),
    "Capabilities: containers[app] adds": _set(
        "containers.0.securityContext.capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
    "Host Ports": _set("containers.0.ports", [{"containerPort": 80, "hostPort": 80}]),
    "Read-only root": _set("containers.0.securityContext.readOnlyRootFilesystem", False),
}


def test_the_checker_passes_a_restricted_pod():
    assert violations(GOOD_POD) == []


@pytest.mark.parametrize("rule", BAD_PODS)
def test_the_checker_rejects_a_pod_that_breaks_a_rule(rule):
    pod = copy.deepcopy(GOOD_POD)
    BAD_PODS[rule](pod)
    problems = violations(pod)
    assert [p for p in problems if p.startswith(rule)], problems
    with pytest.raises(AssertionError, match=re.escape(rule.split(":")[0])):
        assert_restricted({"kind": "Pod", "metadata": {"name": "bad"}, "spec": pod})


def test_a_container_may_set_non_root_itself():
    """The pod-level value is only a default: every container setting it is as good."""
    pod = copy.deepcopy(GOOD_POD)
    del pod["securityContext"]["runAsNonRoot"]
    pod["containers"][0]["securityContext"]["runAsNonRoot"] = True
    assert violations(pod) == []
