"""Names shared by the CRD, the objects the operator makes, and the chart."""

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
FINALIZER = "quire.dev/autoscaler"

CONTAINER_NAME = "quire"
PORT_NAME = "http"
MODELS_MOUNT = "/models"
CACHE_MOUNT = "/var/cache/quire"


def selector_labels(name: str) -> dict[str, str]:
    return {SELECTOR_LABEL: name}


def child_labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "quire",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "server",
        MANAGED_BY_LABEL: MANAGED_BY,
        **selector_labels(name),
    }


def selector_string(name: str) -> str:
    """The label selector in the string form the /scale subresource reports."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))
