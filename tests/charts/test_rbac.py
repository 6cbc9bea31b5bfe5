"""The chart grants exactly the API calls the operator makes (quire_operator.api_calls), no more."""

import pytest

from quire_operator.api_calls import API_CALLS
from quire_operator.router_children import ROUTER_RULES

from chart_render import NAMESPACE, RELEASE, by_kind, render


def granted(rules):
    return {(group, resource, verb)
            for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


# In every watched namespace, and in the operator's own namespace only (the leader-election Lease).
NEEDED = {(c.group, c.resource, verb) for c in API_CALLS if c.scope == "watched" for verb in c.verbs}
OWN = {(c.group, c.resource, verb) for c in API_CALLS if c.scope == "own" for verb in c.verbs}
LEASE_ROLE = f"{RELEASE}-leader-election"


def watched_roles(objects):
    return [r for r in by_kind(objects, "Role") if r["metadata"]["name"] != LEASE_ROLE]


def test_every_call_is_in_one_scope():
    assert {c.scope for c in API_CALLS} == {"watched", "own"}
    assert OWN == {("coordination.k8s.io", "leases", v) for v in ("get", "create", "patch")}


def test_cluster_wide_grants_every_call_and_nothing_else():
    objects = render({"watch": {"clusterWide": True}})
    (role,) = by_kind(objects, "ClusterRole")
    assert granted(role["rules"]) == NEEDED
    assert not watched_roles(objects)
    (binding,) = by_kind(objects, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (account,) = by_kind(objects, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": NAMESPACE}]


@pytest.mark.parametrize("values", [{}, {"watch": {"clusterWide": False, "namespaces": ["llm-a"]}}])
def test_the_lease_is_granted_in_the_release_namespace_only(values):
    objects = render(values)
    (lease_role,) = [r for r in by_kind(objects, "Role") if r["metadata"]["name"] == LEASE_ROLE]
    assert lease_role["metadata"]["namespace"] == NAMESPACE
    assert granted(lease_role["rules"]) == OWN
    (binding,) = [b for b in by_kind(objects, "RoleBinding") if b["metadata"]["name"] == LEASE_ROLE]
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": LEASE_ROLE}
    # Nothing else grants leases anywhere.
    for obj in by_kind(objects, "ClusterRole") + watched_roles(objects):
        assert not {call for call in granted(obj["rules"]) if call[1] == "leases"}


def test_no_lease_rules_without_leader_election():
    objects = render({"leaderElection": {"enabled": False}, "replicaCount": 1})
    assert not [r for r in by_kind(objects, "Role") if r["metadata"]["name"] == LEASE_ROLE]


@pytest.mark.parametrize("namespaces", [[], ["llm-a", "llm-b"]])
def test_single_namespace_mode_needs_no_cluster_role(namespaces):
    objects = render({"watch": {"clusterWide": False, "namespaces": namespaces}})
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    roles = watched_roles(objects)
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(namespaces or [NAMESPACE])
    for role in roles:
        assert granted(role["rules"]) == NEEDED
    bindings = [b for b in by_kind(objects, "RoleBinding") if b["metadata"]["name"] != LEASE_ROLE]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(namespaces or [NAMESPACE])


def test_no_wildcards():
    for obj in render():
        for rule in obj.get("rules", []):
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]


def test_the_operator_holds_what_the_router_role_grants():
    """RBAC lets the operator create the router's Role only with every permission in it."""
    (role,) = by_kind(render({"watch": {"clusterWide": True}}), "ClusterRole")
    assert granted(ROUTER_RULES) <= granted(role["rules"])
