"""The CRD is well formed, the chart ships the same file, and its schema accepts the examples
and rejects broken resources."""

import copy
import pathlib

import jsonschema
import pytest
import yaml
from chart_render import CHART, CRD_FILE

from quire_operator.spec import parse_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / CRD_FILE).read_text())
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def schema_of(crd):
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    return version["schema"]["openAPIV3Schema"]


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
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Model", "Replicas", "Ready", "Queue", "KV", "Age"]


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
    {"autoscaling": {"minReplicas": 0}},
    {"imagePullPolicy": "Sometimes"},
    {"env": [{"value": "no name"}]},
])
def test_broken_resources_are_rejected(spec):
    resource = copy.deepcopy(GOOD)
    for key, value in spec.items():
        resource["spec"][key] = {**resource["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    validator().validate(GOOD)
    with pytest.raises(jsonschema.ValidationError):
        validator().validate(resource)
