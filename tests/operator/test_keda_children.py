"""spec.autoscaling.provider keda as pure functions: the ScaledObject is valid against KEDA's
CRD, scales the LLMDeployment itself within the spec's bounds, from the metrics the runtime (and
router) really export, at the spec's targets; the built-in autoscaler is switched off for it;
bad specs name their field."""

import copy

import crd_rules
import kopf
import pytest
import yaml
from foreign_crds import problems
from prometheus_client import generate_latest

from quire.metrics import SPECS
from quire.router.metrics import RouterMetrics
from quire_operator import handlers, names
from quire_operator.keda_children import HELD_METRIC, KV_METRIC, QUEUE_METRIC, desired_scaled_object
from quire_operator.kube import ApiError
from quire_operator.reconcile import ChildRejected, apply
from quire_operator.spec import SpecError, parse_spec

from operator_harness import CRD_PATH

OWNER = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "chat", "namespace": "llm", "uid": "u-1"}}
PROMETHEUS = "http://prometheus.monitoring.svc:9090"
KEDA = {"enabled": True, "provider": "keda", "minReplicas": 2, "maxReplicas": 6,
        "targetQueueDepth": 3, "targetKVCacheUtilization": 0.75, "pollIntervalSeconds": 20,
        "scaleUpStabilizationSeconds": 30, "scaleDownStabilizationSeconds": 600, "maxScaleUpStep": 2,
        "keda": {"prometheusAddress": PROMETHEUS}}
LLMD_CRD = yaml.safe_load(CRD_PATH.read_text())


def scaled_object(autoscaling, **spec):
    return desired_scaled_object(OWNER, parse_spec({"autoscaling": autoscaling, **spec}))


def test_the_scaled_object_scales_the_llmdeployment_within_its_bounds():
    obj = scaled_object(KEDA)
    assert problems(obj) == []
    assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["metadata"]["name"] == "chat"
    # The LLMDeployment itself, through its /scale subresource (never its Deployment).
    assert obj["spec"]["scaleTargetRef"] == {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
                                             "name": "chat"}
    assert (obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"]) == (2, 6)
    assert obj["spec"]["pollingInterval"] == 20
    behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"] == {"stabilizationWindowSeconds": 30,
                                   "policies": [{"type": "Pods", "value": 2, "periodSeconds": 20}]}
    assert behavior["scaleDown"] == {"stabilizationWindowSeconds": 600}
    (ref,) = obj["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["controller"]) == ("LLMDeployment", "chat", True)


def test_the_triggers_query_what_the_pods_export_at_the_specs_targets():
    queue, kv = scaled_object(KEDA)["spec"]["triggers"]
    for trigger in (queue, kv):
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["serverAddress"] == PROMETHEUS
    # Per replica, as the built-in autoscaler's targets are; strings, as KEDA's metadata is.
    assert queue["metadata"]["threshold"] == "3" and kv["metadata"]["threshold"] == "0.75"
    selector = '{namespace="llm",quire_dev_llmdeployment="chat"}'
    assert queue["metadata"]["query"] == f"sum(quire:num_requests_waiting{selector})"
    assert kv["metadata"]["query"] == f"sum(quire:kv_cache_usage_perc{selector})"
    # Names the runtime really exports (quire.metrics), whatever --metrics-compat says.
    exported = {spec.name for spec in SPECS}
    assert {QUEUE_METRIC, KV_METRIC} <= exported


def test_with_the_router_held_requests_count_as_queue_and_wake_it_from_zero():
    obj = scaled_object({**KEDA, "minReplicas": 0, "idleWindowSeconds": 120}, router={"enabled": True})
    assert problems(obj) == []
    assert obj["spec"]["minReplicaCount"] == 0
    assert obj["spec"]["cooldownPeriod"] == 120  # the idle window before zero
    query = obj["spec"]["triggers"][0]["metadata"]["query"]
    assert query == ('(sum(quire:num_requests_waiting{namespace="llm",quire_dev_llmdeployment="chat"}) '
                     'or vector(0)) + (sum(quire_router:pending_requests'
                     '{namespace="llm",quire_dev_router="chat"}) or vector(0))')
    exported = generate_latest(RouterMetrics().registry).decode()
    assert f"# TYPE {HELD_METRIC} gauge" in exported  # the router's own name for it


@pytest.mark.parametrize("autoscaling", [
    {**KEDA, "provider": "builtin"},
    {**KEDA, "enabled": False},
    {"enabled": True, "maxReplicas": 3},  # provider defaults to builtin
])
def test_no_scaled_object_unless_keda_scales(autoscaling):
    assert scaled_object(autoscaling) is None


def _poll_seconds(autoscaling):
    body = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "chat", "namespace": "llm", "uid": "u-1"}, "spec": {"autoscaling": autoscaling}}
    entry = handlers.llmdeployments(namespace="llm", name="chat", body=body, spec=body["spec"], memo=kopf.Memo())
    return entry["llm", "chat"]["poll_seconds"]


def test_the_builtin_autoscaler_never_polls_a_keda_scaled_object():
    assert _poll_seconds({**KEDA, "provider": "builtin"}) == 20  # the control: it would poll
    assert _poll_seconds(KEDA) is None
    assert parse_spec({"autoscaling": KEDA}).autoscaling.builtin is False


def _llmd(spec):
    return {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": "chat"},
            "spec": copy.deepcopy(spec)}


@pytest.mark.parametrize("spec, field, crd_says", [
    ({"autoscaling": {**KEDA, "keda": None}},
     "spec.autoscaling.keda.prometheusAddress", "keda.prometheusAddress is required when provider is keda"),
    ({"autoscaling": {**KEDA, "keda": {}}},
     "spec.autoscaling.keda.prometheusAddress", "keda.prometheusAddress is required when provider is keda"),
    ({"autoscaling": {**KEDA, "keda": {"prometheusAddress": "prometheus:9090"}}},
     "spec.autoscaling.keda.prometheusAddress", "does not match"),
    ({"autoscaling": {**KEDA, "provider": "hpa"}}, "spec.autoscaling.provider", "is not one of"),
    # Scale to zero through KEDA too needs the router: nothing else holds requests at zero.
    ({"autoscaling": {**KEDA, "minReplicas": 0}},
     "spec.autoscaling.minReplicas", "needs router.enabled"),
])
def test_bad_keda_specs_are_refused_naming_the_field(spec, field, crd_says):
    spec = {key: ({k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value)
            for key, value in spec.items()}
    with pytest.raises(SpecError) as refused:
        parse_spec(spec)
    assert refused.value.field == field
    found = crd_rules.violations(_llmd(spec), LLMD_CRD)
    assert found and crd_says in found[0], found


def test_the_crd_accepts_keda_with_and_without_scale_to_zero():
    assert crd_rules.violations(_llmd({"autoscaling": KEDA}), LLMD_CRD) == []
    zero = {"autoscaling": {**KEDA, "minReplicas": 0}, "router": {"enabled": True}}
    assert crd_rules.violations(_llmd(zero), LLMD_CRD) == []
    assert parse_spec(zero).scale_to_zero.enabled


@pytest.mark.parametrize("change, said", [
    (lambda o: o["spec"]["triggers"][0]["metadata"].update(threshold=3), "3 is not of type 'string'"),
    (lambda o: o["spec"].pop("triggers"), "'triggers' is a required property"),
    (lambda o: o["spec"]["scaleTargetRef"].pop("name"), "'name' is a required property"),
    (lambda o: o["spec"].update(minReplicas=1), "spec.minReplicas: unknown field"),
])
def test_the_vendored_scaled_object_schema_refuses_broken_objects(change, said):
    obj = scaled_object(KEDA)
    change(obj)
    found = problems(obj)
    assert found and said in found[0], found


def test_the_labels_queried_are_the_pods_labels_as_prometheus_writes_them():
    # Prometheus turns every character outside [a-zA-Z0-9_] of a label name into '_'.
    assert "quire_dev_llmdeployment" == names.SELECTOR_LABEL.replace(".", "_").replace("/", "_")


class ClusterWithoutKeda:
    """An API server that does not know the ScaledObject kind (KEDA not installed)."""

    def get(self, group, version, plural, namespace, name):
        return None  # kube.get's answer to a 404

    def create(self, group, version, plural, namespace, body):
        raise ApiError(404, "NotFound", "the server could not find the requested resource")


def test_a_cluster_without_keda_gets_a_rejection_that_says_so():
    with pytest.raises(ChildRejected) as rejected:
        apply(ClusterWithoutKeda(), "llm", scaled_object(KEDA))
    assert "ScaledObject 'chat'" in str(rejected.value) and "is KEDA installed?" in str(rejected.value)
