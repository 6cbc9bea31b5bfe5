"""The chart's networkPolicy: off by default; on, the operator's own pods accept only their
liveness probe, and the operator gets the settings it writes the serving pods' policies from
(tests/operator/test_network_policy.py checks those policies). Everything validates for the
oldest and newest Kubernetes that kubernetes-validate knows here (issue 36)."""

import json
import re

import helm_python as helm
import kubernetes_validate
import pytest

from quire_operator.network_policy import NETWORK_POLICY_ENV, policy_settings

from chart_render import CHART, NAMESPACE, RELEASE, by_kind, render

KUBERNETES_VERSIONS = ["1.29.0", "1.37.0"]
CLIENTS = [{"podSelector": {"matchLabels": {"app": "chat-frontend"}}},
           {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
           {"ipBlock": {"cidr": "10.20.0.0/16"}}]
ON = {"networkPolicy": {"enabled": True, "allowedClients": CLIENTS}}


def operator_env(objects) -> dict:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_off_by_default():
    objects = render()
    assert not by_kind(objects, "NetworkPolicy")
    assert NETWORK_POLICY_ENV not in operator_env(objects)


@pytest.mark.parametrize("values", [ON, {"networkPolicy": {"enabled": True}}])
def test_the_operator_pods_policy_renders_and_validates(values):
    objects = render(values)
    (policy,) = by_kind(objects, "NetworkPolicy")
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(policy, version, strict=True)
    (deployment,) = by_kind(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items() and policy["metadata"]["namespace"] == NAMESPACE
    # Only the liveness port may be reached (by the kubelet; a node's traffic is always let in).
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8080}]}]


def test_the_operator_reads_the_settings_the_chart_gives_it():
    objects = render(ON)
    settings = policy_settings(operator_env(objects))
    assert list(settings.allowed_clients) == CLIENTS
    (deployment,) = by_kind(objects, "Deployment")
    # The operator's scrapes come from pods with these labels, in this namespace.
    assert settings.operator_labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert settings.operator_labels["app.kubernetes.io/instance"] == RELEASE
    assert settings.operator_namespace == NAMESPACE
    assert json.loads(operator_env(render({"networkPolicy": {"enabled": True}}))[NETWORK_POLICY_ENV])[
        "allowedClients"] == []


@pytest.mark.parametrize("clients", [
    [{"podSelectr": {}}],  # a typo
    [{}],  # a peer that names nothing would let everyone in
    [{"ipBlock": {"except": ["10.0.0.0/8"]}}],  # no cidr
    {"podSelector": {}},  # not a list
])
def test_the_values_schema_rejects_bad_client_peers(clients):
    values = {"networkPolicy": {"enabled": True, "allowedClients": clients}}
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError, match=re.escape("allowedClients")):
            chart.validate_schema(chart.merge_values(values))
