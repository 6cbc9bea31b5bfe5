"""The CRD is well formed, the chart ships the same file, and its schema accepts the examples
and rejects broken resources."""

import copy
import pathlib

import crd_rules
import jsonschema
import pytest
import yaml

from quire_operator import names, quantity, tls_spec
from quire_operator.spec import MAX_TENSOR_PARALLEL, SpecError, check_name, parse_spec

from chart_render import CHART, CRD_FILE

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / CRD_FILE).read_text())
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


schema_of = crd_rules.schema_of


def validator():
    # Kubernetes schemas are OpenAPI v3.0: exclusiveMinimum is a boolean, as in draft 4.
    return jsonschema.Draft4Validator(schema_of(CRD))


def test_the_chart_copy_is_identical():
    assert (CHART / "crds" / CRD_FILE).read_bytes() == (ROOT / "crds" / CRD_FILE).read_bytes()
    assert [p.name for p in (ROOT / "crds").iterdir()] == [p.name for p in (CHART / "crds").iterdir()]


def test_crd_is_well_formed():
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == f"{spec['names']['plural']}.{spec['group']}"
    assert (spec["group"], spec["names"]["kind"], spec["names"]["shortNames"]) == ("quire.dev", "LLMDeployment", ["llmd"])
    assert sum(v["storage"] for v in spec["versions"]) == 1
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert "status" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Model", "Replicas", "Ready", "Queue", "KV",
                                                                            "Adapters", "Age"]


def assert_structural(node, path="openAPIV3Schema"):
    """Every node has a type, unless it is int-or-string or keeps unknown fields; no defaults under them."""
    if node.get("x-kubernetes-int-or-string"):
        assert node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], path
        return
    assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in node.get(key, []):
            assert "type" not in branch, f"{path}: types belong on the node, not in {key}"
    for name, child in (node.get("properties") or {}).items():
        assert_structural(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        assert_structural(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        assert_structural(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    assert_structural(schema_of(CRD))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path):
    resources = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "LLMDeployment"]
    assert resources
    for resource in resources:
        validator().validate(resource)
        parse_spec(resource["spec"])  # and the operator accepts them too


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_autoscaled_examples_leave_replicas_to_the_autoscaler(path):
    # A manifest re-applied by a GitOps tool must not reset what the autoscaler chose.
    for resource in [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "LLMDeployment"]:
        if resource["spec"].get("autoscaling", {}).get("enabled"):
            assert "replicas" not in resource["spec"]


def test_examples_cover_what_they_promise():
    smol = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())
    assert "source" not in smol["spec"]["model"]  # the runtime's default model
    assert smol["spec"]["resources"].get("gpus", 0) == 0
    assert (smol["spec"]["autoscaling"]["minReplicas"], smol["spec"]["autoscaling"]["maxReplicas"]) == (1, 3)
    docs = list(yaml.safe_load_all((ROOT / "examples" / "llama-gpu.yaml").read_text()))
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    (llama,) = [d for d in docs if d["kind"] == "LLMDeployment"]
    assert llama["spec"]["model"]["cache"]["claimName"] == pvc["metadata"]["name"]
    assert llama["spec"]["resources"]["gpus"] == 1
    assert {"targetQueueDepth", "targetKVCacheUtilization"} <= set(llama["spec"]["autoscaling"])
    qwen = yaml.safe_load((ROOT / "examples" / "qwen-tensor-parallel.yaml").read_text())
    assert qwen["spec"]["parallelism"]["tensor"] == 2 and "gpus" not in qwen["spec"]["resources"]
    assert parse_spec(qwen["spec"]).resources.gpus == 2  # gpus follows tensor
    docs = list(yaml.safe_load_all((ROOT / "examples" / "smollm2-lora.yaml").read_text()))
    (claim,) = [d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"]
    (lora,) = [parse_spec(d["spec"]) for d in docs if d["kind"] == "LLMDeployment"]
    assert len(lora.adapters) == 2 and {a.claim for a in lora.adapters} == {claim} and lora.lora.enabled


GOOD = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": "x"},
        "spec": {"model": {"source": "gpt2"}}}


@pytest.mark.parametrize("spec", [
    {"replicas": -1},
    {"replicas": "3"},
    {"port": 0},
    {"model": {"pvc": {"path": "x"}}},  # claimName is required
    {"model": {"source": ""}},
    {"runtime": {"kvCacheDtype": "int4"}},
    {"runtime": {"dtype": "fp64"}},
    {"runtime": {"kvCacheMemoryFraction": 0}},
    {"autoscaling": {"targetKVCacheUtilization": 1.5}},
    {"autoscaling": {"minReplicas": -1}},
    {"autoscaling": {"idleWindowSeconds": 5}},
    {"router": {"routing": "random"}},
    {"router": {"replicas": 0}},
    {"imagePullPolicy": "Sometimes"},
    {"env": [{"value": "no name"}]},
    {"parallelism": {"tensor": 0}},
    {"parallelism": {"tensor": 17}},
    {"parallelism": {"shmSize": "2GB"}},
    {"tls": {}},  # secretName is required
    {"tls": {"secretName": ""}},
    {"tls": {"secretName": "Chat_TLS"}},
    {"tls": {"secretName": "a" * 254}},
])
def test_broken_resources_are_rejected(spec):
    resource = copy.deepcopy(GOOD)
    for key, value in spec.items():
        resource["spec"][key] = {**resource["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    validator().validate(GOOD)
    with pytest.raises(jsonschema.ValidationError):
        validator().validate(resource)


# --- validation the API server does with the CRD alone (issue 13): patterns, enums, CEL rules ---

INVALID = sorted((pathlib.Path(__file__).parent / "invalid_llmdeployments").glob("*.yaml"))
# What each manifest breaks, as the API server would say it.
REFUSED_BECAUSE = {
    "autoscaling-without-max.yaml": "maxReplicas is required",
    "block-size-24.yaml": "is not one of",
    "cpu-negative.yaml": "must not be negative",
    "cpu-two.yaml": "does not match",
    "gpus-not-tensor.yaml": "resources.gpus must be unset, 0 (CPU workers) or equal to parallelism.tensor",
    "kv-cache-dtype-int4.yaml": "is not one of",
    "memory-16GB.yaml": "does not match",
    "min-over-max.yaml": "minReplicas must not be greater than maxReplicas",
    "name-too-long.yaml": "is too long",
    "name-with-a-dot.yaml": "does not match",
    "adapter-source-oci.yaml": "oci:// and http(s):// sources are not supported yet",
    "adapter-name-upper-case.yaml": "does not match",
    "shm-size-zero.yaml": "must be greater than 0",
    "tensor-32.yaml": "is greater than the maximum",
    "tls-secret-name-upper-case.yaml": "does not match",
    "zero-without-router.yaml": "autoscaling.minReplicas 0 (scale to zero) needs router.enabled",
}


def test_every_invalid_manifest_says_what_it_breaks():
    assert [p.name for p in INVALID] == sorted(REFUSED_BECAUSE)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_manifests_are_refused_by_the_crd_and_by_the_operator(path):
    resource = yaml.safe_load(path.read_text())
    found = crd_rules.violations(resource, CRD)
    assert found and REFUSED_BECAUSE[path.name] in found[0], found
    # The operator refuses them too, before any write: an older CRD may lack a rule.
    with pytest.raises(SpecError):
        check_name(resource["metadata"]["name"])
        parse_spec(resource["spec"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_every_rule(path):
    for resource in [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "LLMDeployment"]:
        assert crd_rules.violations(resource, CRD) == []


def test_every_cel_rule_parses_and_has_a_message():
    found = list(crd_rules.rules(schema_of(CRD)))
    assert {path for path, _, _ in found} == {".spec", ".spec.resources.cpu", ".spec.resources.memory",
                                              ".spec.parallelism.shmSize", ".spec.autoscaling",
                                              ".spec.adapters[]", ".spec.gateway",
                                              ".spec.kvCache.offload.remote"}
    for path, rule, _ in found:
        crd_rules.compile_rule(rule["rule"])  # raises on a syntax error
        assert rule["message"], path


def _autoscaling_rules_allow(autoscaling):
    node = schema_of(CRD)["properties"]["spec"]["properties"]["autoscaling"]
    return crd_rules.cel_violations(crd_rules.apply_defaults(dict(autoscaling), node), node) == []


@pytest.mark.parametrize("autoscaling, allowed", [
    ({}, True),
    ({"enabled": False}, True),
    ({"enabled": True, "maxReplicas": 3}, True),
    ({"enabled": True, "minReplicas": 3, "maxReplicas": 3}, True),
    ({"enabled": True, "minReplicas": 4, "maxReplicas": 3}, False),
    ({"enabled": True}, False),
    ({"enabled": False, "minReplicas": 5, "maxReplicas": 2}, False),  # wrong even while off
    ({"enabled": True, "minReplicas": 5}, False),  # default-less maxReplicas: required
])
def test_autoscaling_rules_mean_what_they_say(autoscaling, allowed):
    assert _autoscaling_rules_allow(autoscaling) is allowed
    # The operator agrees with the CRD.
    try:
        parse_spec({"autoscaling": autoscaling})
        operator_allows = True
    except SpecError:
        operator_allows = False
    assert operator_allows is allowed


@pytest.mark.parametrize("spec, allowed", [
    ({}, True),
    ({"resources": {"gpus": 4}}, True),  # no parallelism section: as before it existed
    ({"parallelism": {"tensor": 2}}, True),  # the operator asks for 2 GPUs
    ({"parallelism": {"tensor": 2}, "resources": {"cpu": "4"}}, True),  # gpus has no default: still unset
    ({"parallelism": {"tensor": 2}, "resources": {"gpus": 2}}, True),
    ({"parallelism": {"tensor": 2}, "resources": {"gpus": 0}}, True),  # CPU workers over gloo
    ({"parallelism": {"tensor": 2}, "resources": {"gpus": 1}}, False),
    ({"parallelism": {"tensor": 1}, "resources": {"gpus": 2}}, False),
    ({"parallelism": {"shmSize": "1Gi"}, "resources": {"gpus": 2}}, False),  # tensor defaults to 1
])
def test_gpu_rule_means_what_it_says(spec, allowed):
    resource = copy.deepcopy(GOOD)
    resource["spec"].update(copy.deepcopy(spec))
    assert (crd_rules.violations(resource, CRD) == []) is allowed
    # The operator agrees with the CRD.
    try:
        parse_spec(spec)
        operator_allows = True
    except SpecError:
        operator_allows = False
    assert operator_allows is allowed


ON = {"enabled": True, "maxReplicas": 3}


@pytest.mark.parametrize("spec, allowed", [
    ({"autoscaling": {**ON, "minReplicas": 0}, "router": {"enabled": True}}, True),
    ({"autoscaling": {**ON, "minReplicas": 0, "idleWindowSeconds": 60}, "router": {"enabled": True}}, True),
    ({"autoscaling": {**ON, "minReplicas": 1}, "router": {"enabled": True}}, True),
    ({"autoscaling": {**ON, "minReplicas": 0}}, False),  # nothing would hold the requests
    ({"autoscaling": {**ON, "minReplicas": 0}, "router": {"enabled": False}}, False),
    ({"autoscaling": {"maxReplicas": 3, "minReplicas": 0}, "router": {"enabled": True}}, False),  # nothing scales up
    ({"router": {"enabled": True, "routing": "least-load", "replicas": 2}}, True),
])
def test_scale_to_zero_rule_means_what_it_says(spec, allowed):
    resource = copy.deepcopy(GOOD)
    resource["spec"].update(copy.deepcopy(spec))
    found = crd_rules.violations(resource, CRD)
    assert (found == []) is allowed, found
    if not allowed:
        assert any("minReplicas 0" in v for v in found), found
    # The operator agrees with the CRD.
    try:
        parse_spec(spec)
        operator_allows = True
    except SpecError:
        operator_allows = False
    assert operator_allows is allowed


@pytest.mark.parametrize("value, allowed", [
    (4, True), (0, True), ("4", True), ("500m", True), ("16Gi", True), ("0.5", True), ("1e3", True), ("2E", True),
    ("16GB", False), ("two", False), ("-1", False), (-1, False), ("", False), ("1 Gi", False), ("Gi", False),
])
def test_quantities_follow_the_kubernetes_grammar(value, allowed):
    resource = copy.deepcopy(GOOD)
    resource["spec"]["resources"] = {"cpu": value, "memory": value}
    assert (crd_rules.violations(resource, CRD) == []) is allowed
    assert quantity.is_quantity(value) is allowed


def test_crd_patterns_are_the_operators():
    spec = schema_of(CRD)["properties"]["spec"]["properties"]
    for field in ("cpu", "memory"):
        assert spec["resources"]["properties"][field]["pattern"] == quantity.PATTERN
    assert spec["parallelism"]["properties"]["shmSize"]["pattern"] == quantity.PATTERN
    tensor = spec["parallelism"]["properties"]["tensor"]
    assert (tensor["minimum"], tensor["maximum"]) == (1, MAX_TENSOR_PARALLEL)
    name = schema_of(CRD)["properties"]["metadata"]["properties"]["name"]
    assert (name["pattern"], name["maxLength"]) == (names.DNS1035_PATTERN, names.MAX_NAME_LENGTH)
    secret = spec["tls"]["properties"]["secretName"]
    assert (secret["pattern"], secret["maxLength"]) == (tls_spec.SECRET_NAME_PATTERN, tls_spec.MAX_SECRET_NAME_LENGTH)


@pytest.mark.parametrize("tls, allowed", [
    ({"secretName": "chat-tls"}, True),
    ({"secretName": "chat.tls.example"}, True),
    ({"secretName": "-chat"}, False),
    ({"secretName": "chat-tls."}, False),
    ({"secretName": "Chat"}, False),
    ({}, False),
])
def test_the_crd_and_the_operator_agree_on_spec_tls(tls, allowed):
    resource = copy.deepcopy(GOOD)
    resource["spec"]["tls"] = tls
    assert (crd_rules.violations(resource, CRD) == []) is allowed
    try:
        parse_spec(resource["spec"])
        operator_allows = True
    except SpecError:
        operator_allows = False
    assert operator_allows is allowed
