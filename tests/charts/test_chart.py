"""The chart lints, renders under several values sets, and every object it makes is valid."""

import re

import helm_python as helm
import kubernetes_validate
import pytest
import tomllib
import yaml

from chart_render import CHART, NAMESPACE, by_kind, lint, notes, render

VALUE_SETS = {
    "defaults": {},
    "single-namespace": {"watch": {"clusterWide": False}},
    "namespaces": {"watch": {"clusterWide": False, "namespaces": ["llm-a", "llm-b"]}},
    "cluster-wide-verbose": {"watch": {"clusterWide": True}, "verbose": True},
    "service-monitor": {"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}},
    "custom-image-and-resources": {
        "image": {"repository": "registry.example.com/ml/quire-operator", "tag": "1.2.3", "pullPolicy": "Always"},
        "servingImage": {"repository": "registry.example.com/ml/quire", "tag": "1.2.3-cuda"},
        "imagePullSecrets": [{"name": "regcred"}],
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "infra", "operator": "Exists", "effect": "NoSchedule"}],
        "serviceAccount": {"name": "llm-operator", "annotations": {"team": "ml"}},
    },
    "no-rbac-no-serviceaccount": {"rbac": {"create": False}, "serviceAccount": {"create": False}},
    "one-replica-without-leader-election": {"replicaCount": 1, "leaderElection": {"enabled": False}},
    "three-replicas-fast-failover": {"replicaCount": 3, "resyncSeconds": 60, "leaderElection": {
        "enabled": True, "leaseDurationSeconds": 6, "renewDeadlineSeconds": 4, "retryPeriodSeconds": 1}},
}
KUBERNETES_VERSIONS = ["1.29.0", "1.33.0"]


def operator_container(objects):
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lints_and_renders_valid_objects(name):
    values = VALUE_SETS[name]
    report = lint(values)
    assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], report
    objects = render(values)
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # not a Kubernetes type; checked in test_service_monitor_selects_the_runtime_services
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_crd_ships_in_the_chart_and_validates():
    crd = yaml.safe_load((CHART / "crds" / "llmdeployments.quire.dev.yaml").read_text())
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(crd, version, strict=True)


def test_app_version_is_the_project_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((CHART.parents[1] / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    _, container = operator_container(render())
    assert container["image"].endswith(":" + project["version"])
    assert {"name": "QUIRE_DEFAULT_IMAGE", "value": f"ghcr.io/quire-dev/quire:{project['version']}"} in container["env"]


def test_two_operator_replicas_elect_a_leader_and_the_liveness_probe_asks_kopf():
    deployment, container = operator_container(render())
    assert deployment["spec"]["replicas"] == 2
    # Replicas may overlap: only the Lease holder acts.
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert [a for a in container["args"] if a.startswith("--lea") or a.startswith("--renew")
            or a.startswith("--retry")] == [
        "--leader-election", "--lease-name=quire", f"--lease-namespace={NAMESPACE}", "--lease-duration=15",
        "--renew-deadline=10", "--retry-period=2"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    probe = container["livenessProbe"]["httpGet"]
    port = next(p for p in container["ports"] if p["name"] == probe["port"])
    assert (probe["path"], port["containerPort"]) == ("/healthz", 8080)
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True


def test_without_leader_election_one_replica_is_recreated():
    deployment, container = operator_container(render(VALUE_SETS["one-replica-without-leader-election"]))
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "--no-leader-election" in container["args"]


def test_resync_and_lease_timings_follow_the_values():
    deployment, container = operator_container(render(VALUE_SETS["three-replicas-fast-failover"]))
    assert deployment["spec"]["replicas"] == 3
    assert {"--resync-seconds=60", "--lease-duration=6", "--renew-deadline=4", "--retry-period=1"} <= set(container["args"])


def test_watch_scope_follows_the_values():
    _, container = operator_container(render())
    assert "--all-namespaces" in container["args"]
    _, container = operator_container(render(VALUE_SETS["single-namespace"]))
    assert [a for a in container["args"] if a.startswith("--namespace")] == [f"--namespace={NAMESPACE}"]
    _, container = operator_container(render(VALUE_SETS["namespaces"]))
    assert [a for a in container["args"] if a.startswith("--namespace")] == ["--namespace=llm-a", "--namespace=llm-b"]


def test_custom_images_and_resources_are_used():
    objects = render(VALUE_SETS["custom-image-and-resources"])
    deployment, container = operator_container(objects)
    assert container["image"] == "registry.example.com/ml/quire-operator:1.2.3"
    assert container["imagePullPolicy"] == "Always"
    assert {"name": "QUIRE_DEFAULT_IMAGE", "value": "registry.example.com/ml/quire:1.2.3-cuda"} in container["env"]
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "512Mi"}
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "llm-operator"
    (account,) = by_kind(objects, "ServiceAccount")
    assert account["metadata"]["name"] == "llm-operator"


def test_service_monitor_selects_the_runtime_services():
    assert not by_kind(render(), "ServiceMonitor")
    (monitor,) = by_kind(render(VALUE_SETS["service-monitor"]), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    # The labels and port name the operator gives every Service it creates.
    from quire_operator import names
    labels = names.child_labels("any")
    assert all(labels[k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert monitor["spec"]["endpoints"] == [{"port": names.PORT_NAME, "path": "/metrics", "interval": "15s",
                                             "scrapeTimeout": "10s"}]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    # The KEDA ScaledObject's queries select pods by these labels (keda_children.py).
    from quire_operator.keda_children import POD_LABEL, ROUTER_POD_LABEL
    assert [label.replace(".", "_").replace("/", "_") for label in monitor["spec"]["podTargetLabels"]] == [
        POD_LABEL, ROUTER_POD_LABEL]


@pytest.mark.parametrize("values, key", [
    ({"replicaCount": 2, "leaderElection": {"enabled": False}}, "replicaCount"),  # both would act
    ({"replicaCount": -1}, "replicaCount"),
    ({"leaderElection": {"enabled": True, "leaseDurationSeconds": 0}}, "leaseDurationSeconds"),
    ({"watch": {"clusterWide": "yes"}}, "clusterWide"),
    ({"watch": {"clusterWide": False, "namespaces": ["Bad_Name"]}}, "namespaces"),
    ({"serviceMonitor": {"enabled": True, "interval": "soon"}}, "interval"),
    ({"image": {"repository": ""}}, "repository"),
    ({"replicas": 1}, "replicas"),  # a typo for replicaCount
])
def test_values_schema_rejects_bad_values(values, key):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError, match=re.escape(key)):
            chart.validate_schema(chart.merge_values(values))
        with pytest.raises(helm.HelmError):
            chart.render(values=values, name="quire", namespace=NAMESPACE)


@pytest.mark.parametrize("timings", [{"leaseDurationSeconds": 5}, {"leaseDurationSeconds": 10},
                                     {"retryPeriodSeconds": 12}])
def test_leader_election_timings_out_of_order_fail_the_render(timings):
    """The operator exits at start unless retry < renew < lease: a release that renders
    them would crash-loop after a successful install."""
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmError, match="retryPeriodSeconds < renewDeadlineSeconds"):
            chart.render(values={"leaderElection": timings}, name="quire", namespace=NAMESPACE)


def test_pod_labels_cannot_take_the_selectors_keys():
    """A podLabels entry with a selector label's key would leave the operator Deployment's
    selector matching none of its pods (the API server refuses that Deployment)."""
    objects = render({"podLabels": {"app.kubernetes.io/name": "mine", "team": "llm"}})
    deployment, _ = operator_container(objects)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "llm"
    for key, value in deployment["spec"]["selector"]["matchLabels"].items():
        assert labels[key] == value


def test_notes_show_how_to_create_the_first_llmdeployment():
    text = notes()
    assert "kind: LLMDeployment" in text and "kubectl get llmd" in text
    assert "watching every namespace" in text
    assert "watching llm-a,llm-b" in notes(VALUE_SETS["namespaces"])
