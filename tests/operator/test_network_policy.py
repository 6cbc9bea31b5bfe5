"""With the chart's networkPolicy on (QUIRE_NETWORK_POLICY), the operator writes, per
LLMDeployment, the policies that let its serving pods accept only its router, the allowed
clients and the operator, and its router pods only the clients and the operator; they validate
for Kubernetes 1.29 and 1.37, are repaired like every child, and go away when turned off
(issue 36)."""

import json
import re

import kubernetes_validate
import pytest

from quire_operator import names
from quire_operator.network_policy import (
    NETWORK_POLICY_ENV,
    desired_network_policies,
    policy_settings,
)
from quire_operator.spec import parse_spec

from operator_harness import cluster, llmdeployment, running_operator, wait_for  # noqa: F401 (cluster is a fixture)

OWNER = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "chat", "namespace": "team-a", "uid": "u"}}
CLIENTS = [{"podSelector": {"matchLabels": {"app": "chat-frontend"}}},
           {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
OPERATOR = {"namespace": "quire-system",
            "podLabels": {"app.kubernetes.io/name": "quire-operator", "app.kubernetes.io/instance": "quire"}}
SETTINGS = {"allowedClients": CLIENTS, "operator": OPERATOR}
OPERATOR_PEER = {"podSelector": {"matchLabels": OPERATOR["podLabels"]},
                 "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "quire-system"}}}
NETPOL = "networking.k8s.io/v1"


def policies(spec: dict, settings: dict | None = SETTINGS) -> dict[str, dict]:
    env = {} if settings is None else {NETWORK_POLICY_ENV: json.dumps(settings)}
    made = desired_network_policies(OWNER, parse_spec(spec), policy_settings(env))
    return {p["metadata"]["name"]: p for p in made}


def test_serving_pods_accept_the_router_the_clients_and_the_operator_on_their_port_only():
    made = policies({"port": 9000})
    assert list(made) == ["chat"]
    spec = made["chat"]["spec"]
    assert spec["podSelector"] == {"matchLabels": {names.SELECTOR_LABEL: "chat"}}
    assert spec["policyTypes"] == ["Ingress"]  # egress stays open
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"quire.dev/router": "chat"}}}, *CLIENTS,
                            OPERATOR_PEER]
    (ref,) = made["chat"]["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["uid"]) == ("LLMDeployment", "u")


def test_with_the_router_its_pods_accept_only_the_clients_and_the_operator():
    made = policies({"router": {"enabled": True}})
    assert list(made) == ["chat", "chat-router"]
    spec = made["chat-router"]["spec"]
    assert spec["podSelector"] == {"matchLabels": {"quire.dev/router": "chat"}}
    (rule,) = spec["ingress"]
    assert rule == {"from": [*CLIENTS, OPERATOR_PEER], "ports": [{"protocol": "TCP", "port": 8080}]}


def test_without_clients_only_the_router_and_the_operator_get_in():
    made = policies({}, {"allowedClients": [], "operator": OPERATOR})
    assert made["chat"]["spec"]["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {"quire.dev/router": "chat"}}}, OPERATOR_PEER]


def test_off_means_no_policies():
    assert policies({"router": {"enabled": True}}, settings=None) == {}


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
@pytest.mark.parametrize("spec", [{}, {"router": {"enabled": True}, "port": 9000}])
def test_the_policies_validate(spec, version):
    for policy in policies(spec).values():
        kubernetes_validate.validate(policy, version, strict=True)


@pytest.mark.parametrize("raw, field", [
    ("{not json", "not JSON"),
    (json.dumps({"allowedClients": [{"podSelectr": {}}], "operator": OPERATOR}), "allowedClients[0]"),
    (json.dumps({"allowedClients": [{}], "operator": OPERATOR}), "allowedClients[0]"),
    (json.dumps({"allowedClients": {"podSelector": {}}, "operator": OPERATOR}), "allowedClients"),
    (json.dumps({"allowedClients": []}), "operator.namespace"),
    (json.dumps({"operator": {"namespace": "q", "podLabels": {}}}), "operator.podLabels"),
])
def test_bad_settings_are_refused_naming_the_field(raw, field):
    with pytest.raises(ValueError, match=rf"{NETWORK_POLICY_ENV}.*{re.escape(field)}"):
        policy_settings({NETWORK_POLICY_ENV: raw})


def test_the_operator_writes_repairs_and_removes_the_policies(cluster, monkeypatch):
    monkeypatch.setenv(NETWORK_POLICY_ENV, json.dumps(SETTINGS))
    with running_operator():
        cluster.create(llmdeployment("chat", router={"enabled": True}))
        wait_for(lambda: cluster.get(NETPOL, "networkpolicies", "chat")
                 and cluster.get(NETPOL, "networkpolicies", "chat-router"), what="both policies")
        # Drift: a policy someone deletes comes back.
        cluster.delete(NETPOL, "networkpolicies", "chat")
        wait_for(lambda: cluster.get(NETPOL, "networkpolicies", "chat"), what="the policy to come back")
        # The router turned off: its policy goes with it.
        cluster.patch(llmdeployment()["apiVersion"], names.PLURAL, "chat", {"spec": {"router": {"enabled": False}}})
        wait_for(lambda: cluster.get(NETPOL, "networkpolicies", "chat-router") is None,
                 what="the router's policy to go")
    # The chart's networkPolicy turned off: the operator restarts without the setting.
    monkeypatch.delenv(NETWORK_POLICY_ENV)
    with running_operator():
        wait_for(lambda: cluster.get(NETPOL, "networkpolicies", "chat") is None, what="the policy to go")


def test_the_operator_refuses_to_start_with_a_bad_setting(monkeypatch, capsys):
    import kopf

    from quire_operator.__main__ import main
    ran = []
    monkeypatch.setattr(kopf, "run", lambda **kwargs: ran.append(kwargs))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: None)
    monkeypatch.setenv(NETWORK_POLICY_ENV, json.dumps({"allowedClients": [{"pods": {}}], "operator": OPERATOR}))
    assert main(["--no-leader-election"]) == 2
    assert not ran
    assert "allowedClients[0]" in capsys.readouterr().err
