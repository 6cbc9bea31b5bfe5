"""Names shared by the CRD, the objects the operator makes, and the chart."""

import re

GROUP = "quire.dev"
VERSION = "v1alpha1"
PLURAL = "llmdeployments"
KIND = "LLMDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

# Every child carries these; SELECTOR_LABEL alone selects exactly one LLMDeployment's pods.
SELECTOR_LABEL = "quire.dev/llmdeployment"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "quire-operator"

# A hash of what the operator last wrote into a child: equal hash, nothing to write.
HASH_ANNOTATION = "quire.dev/desired-hash"

# kopf keeps its bookkeeping in annotations under this prefix (status fields it would use are
# pruned by the structural schema).
KOPF_PREFIX = "quire.dev"
# No longer added (deletion must work with the operator stopped); kept so that kopf removes it
# from objects an older operator version left it on.
LEGACY_FINALIZER = "quire.dev/autoscaler"

# Every child is named after its LLMDeployment, and that name is also a label value, so the
# name must be a DNS-1035 label: the strictest of the rules (a Service's name) and 63 characters
# (a label value's limit). The CRD carries the same rule.
MAX_NAME_LENGTH = 63
DNS1035_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# A multi-node replica is one LeaderWorkerSet group (lws_children.py). The LWS controller labels
# each pod of a group with its index in the group, 0 for the leader: the only pod that serves.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LEADER_INDEX = "0"

CONTAINER_NAME = "quire"
PORT_NAME = "http"
MODELS_MOUNT = "/models"
CACHE_MOUNT = "/var/cache/quire"


def selector_labels(name: str) -> dict[str, str]:
    return {SELECTOR_LABEL: name}


def serving_selector_labels(name: str, leaders_only: bool = False) -> dict[str, str]:
    """The pods that answer requests: every pod of a single-node replica, the leader of a
    multi-node one (its workers serve no API). What the Services, the router's discovery, the
    InferencePool and /scale select."""
    if not leaders_only:
        return selector_labels(name)
    return {**selector_labels(name), LWS_WORKER_INDEX_LABEL: LEADER_INDEX}


def child_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "quire",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "server",
        MANAGED_BY_LABEL: MANAGED_BY,
        **selector_labels(name),
    }


def selector_string(name: str, leaders_only: bool = False) -> str:
    """The label selector in the string form the /scale subresource reports."""
    return ",".join(f"{k}={v}" for k, v in sorted(serving_selector_labels(name, leaders_only).items()))


def name_problem(name: str) -> str | None:
    """Why the children of an LLMDeployment with this name could not be created, or None."""
    if len(name) > MAX_NAME_LENGTH:
        return (f"{name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH} fit the Service's name "
                "and the pods' label values")
    if not re.match(DNS1035_PATTERN, name):
        return (f"{name!r} is not a valid Service name (DNS-1035: lower-case letters, digits and '-', "
                "starting with a letter and ending with a letter or digit)")
    return None
