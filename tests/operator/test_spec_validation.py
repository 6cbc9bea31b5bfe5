"""Spec parsing, the flags it becomes, and the agreement of the operator's defaults with the CRD's."""

import pathlib

import pytest
import yaml

from quire_operator.pod_template import server_args
from quire_operator.scrape import parse_metrics
from quire_operator.spec import SpecError, parse_spec
from quire_operator.status_writer import contains

CRD = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "crds" / "llmdeployments.quire.dev.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def apply_defaults(obj, schema):
    """Structural defaulting as the API server does it: defaults fill absent fields of objects that exist."""
    for key, prop in (schema.get("properties") or {}).items():
        if key not in obj and "default" in prop:
            obj[key] = prop["default"]
        if isinstance(obj.get(key), dict):
            apply_defaults(obj[key], prop)
    return obj


def test_operator_defaults_equal_the_crd_defaults():
    # Every optional section present but empty, so that every CRD default applies.
    sections = {"model": {}, "resources": {}, "parallelism": {}, "runtime": {}, "podDisruptionBudget": {},
                "autoscaling": {}}
    assert parse_spec(apply_defaults(sections, SPEC_SCHEMA)) == parse_spec({})
    scaling = apply_defaults({"enabled": True, "maxReplicas": 3}, SPEC_SCHEMA["properties"]["autoscaling"])
    assert parse_spec({"autoscaling": scaling}) == parse_spec({"autoscaling": {"enabled": True, "maxReplicas": 3}})


@pytest.mark.parametrize("spec, field", [
    ({"replicas": -1}, "spec.replicas"),
    ({"replicas": "two"}, "spec.replicas"),
    ({"replicas": 2**31}, "spec.replicas"),  # a workload's replicas is an int32
    ({"autoscaling": {"enabled": True, "maxReplicas": 2**31}}, "spec.autoscaling.maxReplicas"),
    ({"port": 70000}, "spec.port"),
    ({"model": {"source": ""}}, "spec.model.source"),
    ({"model": {"source": "no spaces allowed/x y"}}, "spec.model.source"),
    ({"model": {"pvc": {"claimName": "models"}}}, "spec.model.source"),
    ({"model": {"pvc": {"claimName": "models"}, "source": "/abs/path"}}, "spec.model.source"),
    ({"model": {"pvc": {"claimName": "models"}, "source": "../escape"}}, "spec.model.source"),
    ({"model": {"pvc": {}, "source": "x"}}, "spec.model.pvc.claimName"),
    ({"runtime": {"apiKeySecret": {}}}, "spec.runtime.apiKeySecret.name"),
    ({"runtime": {"dtype": "float8"}}, "spec.runtime.dtype"),
    ({"runtime": {"kvCacheMemoryFraction": 0}}, "spec.runtime.kvCacheMemoryFraction"),
    ({"runtime": {"extraArgs": ["--port", "9"]}}, "spec.runtime.extraArgs"),
    ({"runtime": {"extraArgs": "--log-requests"}}, "spec.runtime.extraArgs"),
    ({"resources": {"gpus": 1.5}}, "spec.resources.gpus"),
    ({"resources": {"gpus": 1}, "parallelism": {"tensor": 2}}, "spec.resources.gpus"),
    ({"parallelism": {"tensor": 17}}, "spec.parallelism.tensor"),
    ({"runtime": {"extraArgs": ["--tensor-parallel-size", "2"]}}, "spec.runtime.extraArgs"),
    ({"resources": {"memory": True}}, "spec.resources.memory"),
    ({"env": [{"value": "x"}]}, "spec.env"),
    ({"autoscaling": {"enabled": True}}, "spec.autoscaling.maxReplicas"),
    ({"autoscaling": {"maxReplicas": 2, "targetKVCacheUtilization": 1.5}}, "spec.autoscaling.targetKVCacheUtilization"),
    ({"autoscaling": {"maxReplicas": 2, "targetQueueDepth": 0}}, "spec.autoscaling.targetQueueDepth"),
    ({"autoscaling": "on"}, "spec.autoscaling"),
])
def test_a_bad_field_is_named(spec, field):
    with pytest.raises(SpecError) as raised:
        parse_spec(spec)
    assert raised.value.field == field
    assert str(raised.value).startswith(field + ": ")


@pytest.mark.parametrize("source", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "/models/llama", "/m/model.Q4.gguf"])
def test_sources_that_name_something(source):
    assert parse_spec({"model": {"source": source}}).model.source == source


def test_every_runtime_field_becomes_its_flag():
    spec = parse_spec({
        "model": {"source": "llama/model.gguf", "pvc": {"claimName": "weights"}, "servedName": "llama",
                  "revision": "v2"},
        "port": 8080,
        "runtime": {"dtype": "bfloat16", "maxModelLen": 4096, "blockSize": 32, "maxNumSeqs": 128,
                    "maxNumBatchedTokens": 8192, "kvCacheDtype": "fp8_e5m2", "enablePrefixCaching": False,
                    "kvCacheMemory": 1 << 30, "kvCacheMemoryFraction": 0.85, "maxQueueLen": 500,
                    "shutdownTimeoutSeconds": 90, "logRequests": True, "extraArgs": ["--foo=bar"]},
    })
    assert server_args(spec) == [
        "serve", "/models/llama/model.gguf", "--host", "0.0.0.0", "--port", "8080",
        "--served-model-name", "llama", "--revision", "v2", "--dtype", "bfloat16", "--max-model-len", "4096",
        "--block-size", "32", "--max-num-seqs", "128", "--max-num-batched-tokens", "8192",
        "--kv-cache-dtype", "fp8_e5m2", "--kv-cache-memory", str(1 << 30), "--kv-cache-memory-fraction", "0.85",
        "--max-queue-len", "500", "--shutdown-timeout", "90", "--no-enable-prefix-caching", "--log-requests",
        "--foo=bar"]


def test_the_default_model_needs_no_argument():
    assert server_args(parse_spec({})) == ["serve", "--host", "0.0.0.0", "--port", "8000", "--shutdown-timeout", "30"]


def test_runtime_metrics_text_is_read_per_name():
    text = """\
# HELP quire:num_requests_waiting Requests waiting to be scheduled.
# TYPE quire:num_requests_waiting gauge
quire:num_requests_waiting{model_name="smol"} 3.0
# TYPE quire:num_requests_running gauge
quire:num_requests_running{model_name="smol"} 8.0
# TYPE quire:kv_cache_usage_perc gauge
quire:kv_cache_usage_perc{model_name="smol"} 0.42
# TYPE quire:prompt_tokens counter
quire:prompt_tokens_total{model_name="smol"} 1234.0
"""
    values = parse_metrics(text)
    assert values["quire:num_requests_waiting"] == 3.0
    assert values["quire:num_requests_running"] == 8.0
    assert values["quire:kv_cache_usage_perc"] == 0.42
    assert values["quire:prompt_tokens_total"] == 1234.0


def test_status_patches_that_change_nothing_are_recognised():
    status = {"replicas": 2, "conditions": [{"type": "Ready", "status": "True"}], "autoscaler": {"reason": "x"}}
    assert contains(status, {"replicas": 2, "autoscaler": {"reason": "x"}})
    assert contains(status, {"autoscaler": {"signal": None}})
    assert not contains(status, {"replicas": 3})
    assert not contains(status, {"conditions": [{"type": "Ready", "status": "False"}]})
    assert not contains(status, {"endpoint": "http://x"})


def test_condition_changes_worth_an_event():
    from quire_operator.status import flipped

    ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "1/1"}
    not_ready = {**ready, "status": "False", "reason": "ReplicasNotReady"}
    rolling = {"type": "Progressing", "status": "True", "reason": "RollingOut", "message": ""}
    done = {**rolling, "status": "False", "reason": "RolloutComplete"}
    assert flipped(None, [not_ready, rolling]) == []  # the first status: nothing has changed yet
    assert flipped(None, [ready, done]) == [ready]  # ...unless the pods are ready already
    assert flipped([not_ready, rolling], [ready, done]) == [ready, done]
    assert flipped([ready, done], [ready, done]) == []


def test_with_autoscaling_replicas_is_only_where_the_deployment_starts_within_the_bounds():
    from quire_operator.children import desired_deployment

    owner = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
             "metadata": {"name": "chat", "namespace": "default", "uid": "u"}}

    def replicas(spec):
        return desired_deployment(owner, parse_spec(spec), "img")["spec"]["replicas"]

    # A manifest without replicas gets the CRD's default of 1; the pods start at minReplicas.
    assert replicas({"replicas": 1, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4}}) == 2
    assert replicas({"replicas": 9, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4}}) == 4
    assert replicas({"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4}}) == 3
    assert replicas({"replicas": 9}) == 9  # without autoscaling, replicas is the user's
