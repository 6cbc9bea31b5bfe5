"""spec.kvCache.offload and precise-prefix routing in the objects the operator writes: the
runtime's tier flags, the disk volume (emptyDir or a PVC), the remote URL from a Secret, the
Valkey StatefulSet, the KV-events wiring between the runtime pods and the router; the CRD's
schema (jsonschema + its CEL rule) and the operator refuse the same bad specs."""

from __future__ import annotations

import pathlib

import crd_rules
import kubernetes_validate
import pytest
import yaml

from quire_operator.kv_cache_spec import desired_valkey_children, parse_kv_cache_spec
from quire_operator.pod_template import pod_template
from quire_operator.router_children import (
    desired_router_deployment,
    desired_router_service,
    router_args,
)
from quire_operator.spec import SpecError, parse_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "llmdeployments.quire.dev.yaml").read_text())
OWNER = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}


def _container(spec: dict) -> dict:
    return pod_template("chat", parse_spec(spec), "img")["spec"]["containers"][0]


def _pod(spec: dict) -> dict:
    return pod_template("chat", parse_spec(spec), "img")["spec"]


def _resource(spec: dict) -> dict:
    return {**OWNER, "spec": spec}


def test_host_and_disk_tiers_become_flags_and_a_volume():
    spec = {"kvCache": {"offload": {"hostSize": "8Gi", "disk": {"size": "512Mi"}}}}
    args = _container(spec)["args"]
    assert args[args.index("--kv-offloading-backend") + 1] == "native"
    assert args[args.index("--kv-offloading-size") + 1] == "8"
    assert args[args.index("--kv-offloading-disk-size") + 1] == "0.5"
    path = args[args.index("--kv-offloading-disk-path") + 1]
    volume = next(v for v in _pod(spec)["volumes"] if v["name"] == "kv-offload")
    assert volume["emptyDir"] == {"sizeLimit": "512Mi"}
    mount = next(m for m in _container(spec)["volumeMounts"] if m["name"] == "kv-offload")
    assert mount["mountPath"] == path
    assert "--kv-offloading-remote" not in args and "--kv-events-config" not in args


def test_a_claim_for_the_disk_tier_and_the_remote_url_from_a_secret():
    spec = {"kvCache": {"offload": {
        "disk": {"size": "50Gi", "claimName": "kv-cache"},
        "remote": {"urlSecret": {"name": "kv", "key": "url"}}}}}
    container = _container(spec)
    volume = next(v for v in _pod(spec)["volumes"] if v["name"] == "kv-offload")
    assert volume["persistentVolumeClaim"] == {"claimName": "kv-cache"}
    args = container["args"]
    ref = args[args.index("--kv-offloading-remote") + 1]
    env = {e["name"]: e for e in container["env"]}
    assert ref == "$(QUIRE_KV_REMOTE_URL)"  # the kubelet expands it from the env
    assert env["QUIRE_KV_REMOTE_URL"]["valueFrom"] == {"secretKeyRef": {"name": "kv", "key": "url"}}
    assert "--kv-offloading-size" not in args


def test_an_operator_run_valkey_for_the_shared_tier():
    spec = {"kvCache": {"offload": {"remote": {"valkey": {"memory": "2Gi"}}}}}
    args = _container(spec)["args"]
    assert args[args.index("--kv-offloading-remote") + 1] == "redis://chat-kv:6379/0"
    service, statefulset = desired_valkey_children(OWNER, parse_spec(spec).kv_offload)
    assert service["metadata"]["name"] == statefulset["metadata"]["name"] == "chat-kv"
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--maxmemory") + 1] == str(2 * 2**30)
    assert "allkeys-lru" in container["args"]
    # its pod is not the runtime's: the runtime's Service selector must not pick it
    runtime_selector = pod_template("chat", parse_spec(spec), "img")["metadata"]["labels"]
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert not set(runtime_selector.items()) <= set(labels.items())
    assert service["spec"]["selector"] == labels
    for obj in (service, statefulset):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        kubernetes_validate.validate(obj, "1.29.0", strict=True)
    assert desired_valkey_children(OWNER, parse_spec({}).kv_offload) == []


def test_precise_prefix_wires_the_replicas_events_to_the_router():
    spec = parse_spec({"router": {"enabled": True, "routing": "precise-prefix"}, "port": 9000})
    args = router_args("chat", spec.router)
    assert args[args.index("--kv-events-bind") + 1] == "tcp://*:5557"
    assert "--block-size" in args  # it hashes prompts as the replicas do
    deployment = desired_router_deployment(OWNER, spec.router, "img")
    ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in ports
    service = desired_router_service(OWNER, spec.router)
    assert any(p["name"] == "kv-events" and p["port"] == 5557 for p in service["spec"]["ports"])
    container = pod_template("chat", spec, "img")["spec"]["containers"][0]
    import json
    config = json.loads(container["args"][container["args"].index("--kv-events-config") + 1])
    assert config["endpoint"] == "tcp://chat:5557" and config["enable_kv_cache_events"] is True
    assert config["topic"] == "kv@$(QUIRE_POD_IP):9000@chat"
    env = {e["name"]: e for e in container["env"]}
    assert env["QUIRE_POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    for obj in (deployment, service):
        kubernetes_validate.validate(obj, "1.29.0", strict=True)
    # other routings leave the runtime pods' events off
    plain = pod_template("chat", parse_spec({"router": {"enabled": True}}), "img")
    assert "--kv-events-config" not in plain["spec"]["containers"][0]["args"]


GOOD = [
    {"kvCache": {"offload": {"hostSize": "8Gi"}}},
    {"kvCache": {"offload": {"hostSize": 1073741824, "disk": {"size": "50Gi", "claimName": "kv"}}}},
    {"kvCache": {"offload": {"remote": {"url": "redis://valkey.cache:6379/0"}}}},
    {"kvCache": {"offload": {"remote": {"valkey": {}}}}},
    {"router": {"enabled": True, "routing": "precise-prefix"}},
]
BAD = [
    ({"kvCache": {"offload": {"hostSize": "lots"}}}, "spec.kvCache.offload.hostSize"),
    ({"kvCache": {"offload": {"hostSize": "0"}}}, "spec.kvCache.offload.hostSize"),
    ({"kvCache": {"offload": {"disk": {"claimName": "kv"}}}}, "spec.kvCache.offload.disk.size"),
    ({"kvCache": {"offload": {"remote": {"url": "http://cache:6379"}}}},
     "spec.kvCache.offload.remote.url"),
    ({"kvCache": {"offload": {"remote": {"url": "redis://a:1", "valkey": {}}}}},
     "spec.kvCache.offload.remote"),
    ({"kvCache": {"offload": {"remote": {"valkey": {"memory": "a lot"}}}}},
     "spec.kvCache.offload.remote.valkey.memory"),
    ({"router": {"enabled": True, "routing": "precise-prefix", "replicas": 2}}, "spec.router.replicas"),
]


@pytest.mark.parametrize("spec", GOOD)
def test_good_specs_pass_the_crd_and_the_operator(spec):
    assert crd_rules.violations(_resource(spec), CRD) == []
    parse_spec(spec)


@pytest.mark.parametrize("spec, field", BAD)
def test_bad_specs_are_refused_by_the_operator_naming_the_field(spec, field):
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert e.value.field == field


# what the schema can say: not a zero size, a missing disk.size's meaning, or one router
@pytest.mark.parametrize("spec, field", [BAD[i] for i in (0, 3, 4, 5)])
def test_the_crd_refuses_them_too(spec, field):
    assert crd_rules.violations(_resource(spec), CRD), spec


def test_offload_needs_prefix_caching():
    with pytest.raises(SpecError) as e:
        parse_spec({"kvCache": {"offload": {"hostSize": "1Gi"}},
                    "runtime": {"enablePrefixCaching": False}})
    assert e.value.field == "spec.kvCache.offload"
    assert not parse_kv_cache_spec({}).enabled
