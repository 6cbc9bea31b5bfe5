"""Every Kubernetes API call the operator makes, kopf's own included: the one list.

kube.py refuses a call that is not listed here, the chart's RBAC rules are checked against it
(tests/charts/test_rbac.py), and the operator tests check that every request the emulated API
server received is listed (tests/operator/conftest.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class ApiCall:
    group: str  # "" is the core group
    resource: str  # a plural, or plural/subresource
    verbs: tuple[str, ...]
    why: str
    # "watched": in every namespace the operator watches (ClusterRole, or a Role in each);
    # "own": only in the operator's own namespace (a Role there).
    scope: str = "watched"


API_CALLS: tuple[ApiCall, ...] = (
    ApiCall("quire.dev", "llmdeployments", ("get", "list", "watch", "patch"),
            "kopf watches them and patches its annotations and finalizer; status updates re-read them"),
    ApiCall("quire.dev", "llmdeployments/status", ("patch",), "conditions, replicas, autoscaler decisions"),
    ApiCall("quire.dev", "llmdeployments/scale", ("get", "patch"), "the autoscaler sets replicas as HPA would"),
    ApiCall("apps", "deployments", ("get", "list", "watch", "create", "patch", "delete"),
            "the pods' and the router's Deployments; watched (by label) for drift, the pods' status feeds "
            "the LLMDeployment's; the router's is deleted when spec.router is turned off"),
    ApiCall("", "services", ("get", "list", "watch", "create", "patch", "delete"),
            "the in-cluster endpoint and the router's headless <name>-pods; watched (by label) for drift "
            "and deletion; <name>-pods is deleted when spec.router is turned off"),
    ApiCall("", "serviceaccounts", ("get", "list", "watch", "create", "patch", "delete"),
            "the router pods' identity; watched (by label) for drift"),
    ApiCall("rbac.authorization.k8s.io", "roles", ("get", "list", "watch", "create", "patch", "delete"),
            "the router's Role (list/watch endpointslices); watched (by label) for drift"),
    ApiCall("rbac.authorization.k8s.io", "rolebindings", ("get", "list", "watch", "create", "patch", "delete"),
            "binds the router's Role to its ServiceAccount; watched (by label) for drift"),
    ApiCall("discovery.k8s.io", "endpointslices", ("list", "watch"),
            "never called: the router's Role grants it, and RBAC lets one grant only what one holds"),
    ApiCall("policy", "poddisruptionbudgets", ("get", "list", "watch", "create", "patch", "delete"),
            "the optional PDB; watched (by label) for drift"),
    ApiCall("apps", "statefulsets", ("get", "create", "patch", "delete"),
            "spec.kvCache.offload.remote.valkey's Valkey; not watched: the resync repairs it"),
    # Kinds of optional CRDs: not watched (kopf would stall on a kind the cluster lacks); the
    # periodic resync repairs their drift. Deleted when the spec stops asking for them.
    ApiCall("inference.networking.k8s.io", "inferencepools", ("get", "create", "patch", "delete"),
            "spec.gateway.inferencePool: the runtime pods as a Gateway API Inference Extension pool"),
    ApiCall("inference.networking.x-k8s.io", "inferenceobjectives", ("get", "list", "create", "patch", "delete"),
            "spec.gateway.objectives: GIE InferenceObjectives (request priorities) on the pool; listed by "
            "label to delete those the spec no longer names"),
    ApiCall("gateway.networking.k8s.io", "httproutes", ("get", "create", "patch", "delete"),
            "spec.gateway.httpRoute: attaches the InferencePool to the Gateways named"),
    ApiCall("keda.sh", "scaledobjects", ("get", "create", "patch", "delete"),
            "spec.autoscaling.provider keda: KEDA scales the LLMDeployment through /scale"),
    ApiCall("networking.k8s.io", "networkpolicies", ("get", "list", "watch", "create", "patch", "delete"),
            "with the chart's networkPolicy.enabled: who may reach the serving and router pods; "
            "watched (by label) for drift; deleted when it (or spec.router) is turned off"),
    # An optional CRD's kind, yet watched: kopf skips a kind the cluster lacks with a warning.
    ApiCall("leaderworkerset.x-k8s.io", "leaderworkersets", ("get", "list", "watch", "create", "patch", "delete"),
            "spec.parallelism.pipeline > 1: the multi-node replicas (in place of the Deployment, which is "
            "deleted, and deleted when pipeline is 1 again); watched (by label) for drift and its status"),
    ApiCall("", "pods", ("list", "watch"), "an index of ready pods, whose /metrics the autoscaler scrapes"),
    ApiCall("", "events", ("create",), "Events on state changes and failures"),
    ApiCall("", "secrets", ("get",),
            "only the Secrets an LLMDeployment names: spec.runtime.apiKeySecret, when spec.adapters is set (the "
            "runtime requires that key on its adapter endpoints), and spec.tls.secretName (its CA verifies the "
            "pods the operator scrapes and calls over HTTPS)"),
    ApiCall("coordination.k8s.io", "leases", ("get", "create", "patch"),
            "leader election: only the replica holding the Lease acts", scope="own"),
)
# Nothing cluster-scoped: kopf's runtime scanning of namespaces and CRDs is off (handlers.configure),
# so a single-namespace install needs Roles only.

# Discovery: read-only, granted to every authenticated user by the system:discovery role.
_DISCOVERY = re.compile(r"^/version/?$|^/api(/[^/]+)?/?$|^/apis(/[^/]+){0,2}/?$")


def allowed(group: str, resource: str, verb: str, calls: Iterable[ApiCall] = API_CALLS) -> bool:
    return any(c.group == group and c.resource == resource and verb in c.verbs for c in calls)


def classify(method: str, url: str) -> tuple[str, str, str] | None:
    """(group, resource, verb) of an API request, or None for discovery."""
    parts = urlsplit(url)
    path, query = parts.path, parse_qs(parts.query)
    if _DISCOVERY.match(path):
        return None
    segments = path.strip("/").split("/")
    if segments[0] == "api":
        group, rest = "", segments[2:]
    elif segments[0] == "apis":
        group, rest = segments[1], segments[3:]
    else:
        raise ValueError(f"not a Kubernetes API path: {path}")
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) != 2:
        rest = rest[2:]  # namespaced; a bare namespaces/NAME is the namespace object itself
    plural, name, sub = (rest + [None, None])[:3]
    resource = f"{plural}/{sub}" if sub else plural
    method = method.upper()
    if method == "GET":
        verb = "watch" if query.get("watch", [""])[0] in ("true", "1") else ("get" if name else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update",
                "DELETE": "delete" if name else "deletecollection"}[method]
    return group, resource, verb
