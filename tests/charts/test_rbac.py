"""The chart grants exactly the API calls the operator makes (quire_operator.api_calls), no more."""

import pytest
from chart_render import NAMESPACE, by_kind, render

from quire_operator.api_calls import API_CALLS


def granted(rules):
    return {(group, resource, verb)
            for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


NEEDED = {(c.group, c.resource, verb) for c in API_CALLS for verb in c.verbs}


def test_cluster_wide_grants_every_call_and_nothing_else():
    objects = render({"watch": {"clusterWide": True}})
    (role,) = by_kind(objects, "ClusterRole")
    assert granted(role["rules"]) == NEEDED
    assert not by_kind(objects, "Role")
    (binding,) = by_kind(objects, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (account,) = by_kind(objects, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": NAMESPACE}]


@pytest.mark.parametrize("namespaces", [[], ["llm-a", "llm-b"]])
def test_single_namespace_mode_needs_no_cluster_role(namespaces):
    objects = render({"watch": {"clusterWide": False, "namespaces": namespaces}})
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    roles = by_kind(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(namespaces or [NAMESPACE])
    for role in roles:
        assert granted(role["rules"]) == NEEDED
    bindings = by_kind(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(namespaces or [NAMESPACE])


def test_no_wildcards():
    for obj in render():
        for rule in obj.get("rules", []):
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
