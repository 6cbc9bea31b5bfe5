"""What counts as drift: fields the operator set and someone changed, not what the API server
or other controllers added (issue 13, item 2)."""

import copy

import pytest

from quire_operator import names
from quire_operator.children import desired_deployment, owner_of, with_hash
from quire_operator.drift import covers, drift_of, patch_for
from quire_operator.spec import parse_spec

OWNER = owner_of({"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
                  "metadata": {"name": "chat", "namespace": "default", "uid": "u1"}})
DESIRED = with_hash(desired_deployment(OWNER, parse_spec({"resources": {"cpu": "0.5", "gpus": 1, "memory": "1Gi"}}),
                                       "img:1"))


def live_as_the_server_keeps_it():
    """What the API server stores: defaults added, quantities in canonical form."""
    live = copy.deepcopy(DESIRED)
    live["metadata"].update(uid="d1", resourceVersion="7", generation=1)
    live["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "1"
    pod = live["spec"]["template"]["spec"]
    pod.update(restartPolicy="Always", dnsPolicy="ClusterFirst", schedulerName="default-scheduler")
    container = pod["containers"][0]
    container.update(terminationMessagePath="/dev/termination-log", imagePullPolicy="IfNotPresent")
    container["readinessProbe"]["successThreshold"] = 1
    container["resources"] = {"requests": {"cpu": "500m", "memory": "1Gi"},
                              "limits": {"memory": "1Gi", "nvidia.com/gpu": "1"}}
    live["status"] = {"replicas": 1}
    return live


def test_what_the_server_adds_is_not_drift():
    assert drift_of(live_as_the_server_keeps_it(), DESIRED) is None


@pytest.mark.parametrize("change, part", [
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(image="other:2"), "spec.template"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("livenessProbe"), "spec.template"),
    (lambda d: d["spec"].update(replicas=4), "spec.replicas"),
    (lambda d: d["spec"]["template"]["spec"]["containers"].append({"name": "sidecar"}), "spec.template"),
    (lambda d: d["metadata"]["labels"].pop(names.SELECTOR_LABEL), "metadata.labels"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"].update(cpu="2"),
     "spec.template"),
])
def test_a_change_to_what_the_operator_set_is_drift(change, part):
    live = live_as_the_server_keeps_it()
    change(live)
    assert drift_of(live, DESIRED) == part


def test_quantities_compare_by_value():
    assert covers({"cpu": "500m"}, {"cpu": "0.5"}) and covers({"gpu": "1"}, {"gpu": 1})
    assert not covers({"cpu": "400m"}, {"cpu": "0.5"})


def test_an_extra_key_in_a_services_selector_is_drift_and_the_patch_removes_it():
    desired = {"kind": "Service", "spec": {"selector": {"quire.dev/router": "chat"}}}
    live = {"kind": "Service", "spec": {"selector": {"quire.dev/router": "chat", "quire.dev/llmdeployment": "chat"},
                                        "clusterIP": "10.0.0.1"}}
    assert drift_of(live, desired) == "spec.selector"
    assert patch_for(live, desired)["spec"]["selector"] == {"quire.dev/router": "chat", "quire.dev/llmdeployment": None}
    assert drift_of({"kind": "Service", "spec": {"selector": {"quire.dev/router": "chat"}}}, desired) is None


def _without_empty_strings(value):
    """The API server's omitempty: an empty string is not stored (nor keys it does not know,
    which the spec passes through no more)."""
    if isinstance(value, dict):
        return {k: _without_empty_strings(v) for k, v in value.items() if v != ""}
    if isinstance(value, list):
        return [_without_empty_strings(v) for v in value]
    return value


def test_empty_strings_and_unknown_keys_in_env_and_tolerations_are_not_drift():
    """env {value: ""} and a toleration's empty fields were sent, dropped by the server, and
    then seen missing on every read: a patch and a DriftCorrected Event at each event."""
    spec = parse_spec({"env": [{"name": "EMPTY", "value": ""}, {"name": "X", "value": "1", "note": 2}],
                       "tolerations": [{"key": "gpu", "operator": "Exists", "value": "", "effect": "",
                                        "extra": True}]})
    assert spec.env == ({"name": "EMPTY"}, {"name": "X", "value": "1"})
    assert spec.tolerations == ({"key": "gpu", "operator": "Exists"},)
    desired = with_hash(desired_deployment(OWNER, spec, "img:1"))
    live = _without_empty_strings(copy.deepcopy(desired))
    live["metadata"].update(uid="d1", resourceVersion="7", generation=1)
    assert drift_of(live, desired) is None


def test_an_env_name_that_is_not_a_string_is_named():
    from quire_operator.spec import SpecError
    with pytest.raises(SpecError, match=r"spec.env\[0\].name: must be a string"):
        parse_spec({"env": [{"name": ["A"]}]})
