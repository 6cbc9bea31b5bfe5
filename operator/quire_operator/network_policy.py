"""NetworkPolicies for an LLMDeployment's pods, when the chart's `networkPolicy.enabled` asks
(it sets QUIRE_NETWORK_POLICY to JSON: the allowed clients and the operator's own pods).

    <name>          the serving pods accept connections on the serving port only from
                    the LLMDeployment's router pods, the allowed clients, and the operator's pods
                    (its /metrics scrapes, the adapter sync, the scale-from-zero probe); with
                    multi-node replicas, also any port from the LLMDeployment's own pods
    <name>-router   with spec.router: the router pods accept connections on their port only
                    from the allowed clients and the operator's pods (otherwise the router would
                    be an open door to the serving pods); with precise-prefix routing, also
                    the serving pods' KV-cache events on port 5557

The operator writes them, not the chart: a NetworkPolicy selects pods in its own namespace only,
and LLMDeployments live in any namespace the operator watches, including namespaces made after
the chart was installed. Egress is left open (the router reads EndpointSlices and proxies to
the replicas). The kubelet's probes come from the pod's node, which a NetworkPolicy always lets
in. Allowed clients are NetworkPolicyPeers: a peer with only a podSelector selects pods in the
LLMDeployment's own namespace.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from . import names
from .router_children import (
    KV_EVENTS_PORT,
    ROUTER_PORT,
    router_labels,
    router_name,
    router_selector_labels,
)
from .spec import LLMSpec

NETWORK_POLICY_ENV = "QUIRE_NETWORK_POLICY"
PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace since Kubernetes 1.22


@dataclass(frozen=True)
class PolicySettings:
    allowed_clients: tuple[dict, ...]
    operator_namespace: str
    operator_labels: dict[str, str]


def policy_settings(environ: Mapping[str, str] = os.environ) -> PolicySettings | None:
    """The settings the chart passed, or None (no NetworkPolicies). Bad JSON or fields raise
    ValueError naming the field and what is allowed."""
    raw = environ.get(NETWORK_POLICY_ENV)
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{NETWORK_POLICY_ENV} is not JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) - {"allowedClients", "operator"}:
        raise ValueError(f"{NETWORK_POLICY_ENV} must be an object with allowedClients and operator")
    clients = doc.get("allowedClients") or []
    if not isinstance(clients, list):
        raise ValueError(f"{NETWORK_POLICY_ENV}: allowedClients must be a list of NetworkPolicyPeers")
    for i, peer in enumerate(clients):
        if not isinstance(peer, dict) or not peer or set(peer) - set(PEER_KEYS):
            raise ValueError(f"{NETWORK_POLICY_ENV}: allowedClients[{i}] must be an object with "
                             f"{', '.join(PEER_KEYS)} (at least one), got {peer!r}")
    operator = doc.get("operator")
    namespace = operator.get("namespace") if isinstance(operator, dict) else None
    labels = operator.get("podLabels") if isinstance(operator, dict) else None
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"{NETWORK_POLICY_ENV}: operator.namespace must be the operator's namespace")
    if not isinstance(labels, dict) or not labels or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ValueError(f"{NETWORK_POLICY_ENV}: operator.podLabels must map label names to values "
                         "(what selects the operator's pods)")
    return PolicySettings(tuple(clients), namespace, dict(labels))


def policy_names(name: str) -> list[str]:
    """Every NetworkPolicy an LLMDeployment may own: what to delete when they are turned off."""
    return [name, router_name(name)]


def desired_network_policies(owner: Mapping[str, Any], spec: LLMSpec,
                             settings: PolicySettings | None) -> list[dict]:
    if settings is None:
        return []
    name = owner["metadata"]["name"]
    operator = {"podSelector": {"matchLabels": dict(settings.operator_labels)},
                "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: settings.operator_namespace}}}
    clients = [dict(peer) for peer in settings.allowed_clients]
    router = {"podSelector": {"matchLabels": router_selector_labels(name)}}
    policies = [_policy(owner, name, names.child_labels(name), names.selector_labels(name),
                        spec.port, [router, *clients, operator])]
    if spec.parallelism.multi_node:
        # A multi-node replica's pods (leader and workers, all under this policy) reach each other
        # on the rendezvous and control ports and on the ports NCCL picks at run time: any port,
        # from this LLMDeployment's own pods only.
        policies[0]["spec"]["ingress"].append({"from": [{"podSelector": {"matchLabels": names.selector_labels(name)}}]})
    if spec.router.enabled:
        policy = _policy(owner, router_name(name), router_labels(name),
                         router_selector_labels(name), ROUTER_PORT, [*clients, operator])
        if spec.router.routing == "precise-prefix":  # the serving pods publish KV events to it
            policy["spec"]["ingress"].append({
                "from": [{"podSelector": {"matchLabels": names.selector_labels(name)}}],
                "ports": [{"protocol": "TCP", "port": KV_EVENTS_PORT}]})
        policies.append(policy)
    return policies


def _policy(owner: Mapping[str, Any], name: str, labels: dict, selector: dict, port: int,
            peers: list[dict]) -> dict:
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": port}]}],
        },
    }
    kopf.adopt(policy, owner=owner)
    return policy
