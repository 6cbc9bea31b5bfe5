"""The operator's router pieces, all pure: spec.router parsing, the router's children, and the
scale-to-zero decision."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from quire.router.backends import BackendSet
from quire.router.metrics import RouterMetrics
from quire_operator import names
from quire_operator.router_children import (
    desired_headless_service,
    desired_router_deployment,
    desired_router_role,
    desired_router_role_binding,
    desired_router_service,
    router_children,
)
from quire_operator.router_spec import (
    ROUTING_POLICIES,
    RouterSpec,
    parse_router_spec,
    parse_scale_to_zero,
)
from quire_operator.scale_to_zero import (
    ColdStart,
    RouterSignal,
    cold_start_finished,
    cold_start_status,
    combine_router_signals,
    decide_scale_to_zero,
    router_signal_from_metrics,
)
from quire_operator.spec import SpecError, parse_spec

OWNER = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "chat", "namespace": "ml", "uid": "u-1"}}
CRD = Path(__file__).resolve().parents[2] / "crds" / "llmdeployments.quire.dev.yaml"


def test_router_spec_defaults_and_the_runtime_fields_it_borrows():
    assert parse_router_spec({}) == RouterSpec()
    spec = parse_router_spec({"port": 9000, "model": {"source": "org/model"},
                              "runtime": {"blockSize": 32},
                              "router": {"enabled": True, "replicas": 2, "routing": "least-load"}})
    assert (spec.enabled, spec.replicas, spec.routing) == (True, 2, "least-load")
    assert (spec.runtime_port, spec.model_source, spec.block_size) == (9000, "org/model", 32)


@pytest.mark.parametrize("router, field", [
    ({"routing": "random"}, "spec.router.routing"),
    ({"replicas": 0}, "spec.router.replicas"),
    ({"enabled": "yes"}, "spec.router.enabled"),
    ({"holdTimeoutSeconds": 0}, "spec.router.holdTimeoutSeconds"),
    ({"maxPending": -1}, "spec.router.maxPending"),
])
def test_bad_router_fields_are_named(router, field):
    with pytest.raises(SpecError) as e:
        parse_router_spec({"router": router})
    assert e.value.field == field


def test_min_replicas_zero_needs_the_autoscaler_and_the_router():
    on = parse_router_spec({"router": {"enabled": True}})
    off = parse_router_spec({})
    scaling = {"autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 3,
                               "idleWindowSeconds": 120}}
    assert parse_scale_to_zero(scaling, on).enabled
    assert parse_scale_to_zero(scaling, on).idle_window_seconds == 120
    assert not parse_scale_to_zero({"autoscaling": {"minReplicas": 1}}, on).enabled
    with pytest.raises(SpecError, match="router.enabled"):
        parse_scale_to_zero(scaling, off)
    with pytest.raises(SpecError, match="autoscaling.enabled"):
        parse_scale_to_zero({"autoscaling": {"minReplicas": 0}}, on)


def test_the_crd_has_the_parsers_defaults():
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]
    fragment = schema["openAPIV3Schema"]["properties"]["spec"]["properties"]
    props = fragment["router"]["properties"]
    defaults = RouterSpec()
    assert props["routing"]["enum"] == list(ROUTING_POLICIES)
    assert (props["enabled"]["default"], props["replicas"]["default"], props["routing"]["default"],
            props["maxPending"]["default"], props["holdTimeoutSeconds"]["default"]) == (
        defaults.enabled, defaults.replicas, defaults.routing, defaults.max_pending,
        defaults.hold_timeout_seconds)
    assert fragment["autoscaling"]["properties"]["minReplicas"]["minimum"] == 0


def test_router_children_keep_clients_address_and_never_match_the_runtime_selector():
    spec = parse_router_spec({"port": 8000, "model": {"source": "org/model"},
                              "router": {"enabled": True, "replicas": 2}})
    deployment = desired_router_deployment(OWNER, spec, "quire:1")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert names.SELECTOR_LABEL not in pod_labels  # the runtime Deployment must not adopt them
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert deployment["spec"]["replicas"] == 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == "router" and container["image"] == "quire:1"
    assert args[args.index("--k8s-service") + 1] == "chat-pods"
    assert args[args.index("--routing") + 1] == "prefix-aware"
    assert args[args.index("--model") + 1] == "org/model"
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "chat-router"

    main = desired_router_service(OWNER, spec)
    assert main["metadata"]["name"] == "chat"  # the address clients already use
    assert main["spec"]["selector"].items() <= pod_labels.items()
    assert main["spec"]["ports"][0]["port"] == 8000

    headless = desired_headless_service(OWNER, spec)
    assert headless["metadata"]["name"] == "chat-pods"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == names.selector_labels("chat")

    role = desired_router_role(OWNER)
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]
    binding = desired_router_role_binding(OWNER)
    assert binding["subjects"][0] == {"kind": "ServiceAccount", "name": "chat-router",
                                      "namespace": "ml"}
    kinds = [o["kind"] for o in router_children(OWNER, spec, "quire:1")]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "Service", "Deployment"]
    assert router_children(OWNER, parse_router_spec({}), "quire:1") == []


def test_a_pvc_model_is_mounted_for_the_routers_tokenizer():
    spec = parse_router_spec({"model": {"source": "llama/model.gguf", "pvc": {"claimName": "m"}},
                              "router": {"enabled": True}})
    pod = desired_router_deployment(OWNER, spec, "quire:1")["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == f"{names.MODELS_MOUNT}/llama/model.gguf"
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "m", "readOnly": True}


NOW = 10_000.0


def decide(current, ready, signal, window=300, minimum=0, maximum=4):
    return decide_scale_to_zero(current_replicas=current, ready_replicas=ready, signal=signal,
                                now=NOW, idle_window_seconds=window, min_replicas=minimum,
                                max_replicas=maximum)


@pytest.mark.parametrize("current, ready, pending, idle, minimum, want, reason", [
    (0, 0, 1, 0, 0, 1, "scale-from-zero"),
    (0, 0, 0, 999, 0, 0, "idle"),
    (1, 0, 3, 999, 0, 1, "held-requests"),      # starting up: never taken away
    (2, 2, 0, 299, 0, 2, "within-idle-window"),
    (2, 2, 0, 300, 0, 0, "idle"),
    (2, 2, 0, 9999, 1, 2, "disabled"),          # minReplicas 1: not our business
])
def test_scale_to_zero_decisions(current, ready, pending, idle, minimum, want, reason):
    d = decide(current, ready, RouterSignal(pending, NOW - idle), minimum=minimum)
    assert (d.replicas, d.reason) == (want, reason)
    assert d.message


def test_an_unreadable_router_never_scales_to_zero():
    assert decide(2, 2, None).replicas == 2
    assert combine_router_signals([RouterSignal(0, 1.0), None]) is None
    both = combine_router_signals([RouterSignal(1, 5.0, 7.0), RouterSignal(2, 9.0, 3.0)])
    assert both == RouterSignal(3, 9.0, 7.0)


def test_the_decision_reads_the_routers_own_metrics():
    metrics = RouterMetrics()
    metrics.pending.set(2)
    metrics.request_arrived()
    signal = router_signal_from_metrics(metrics.render(BackendSet()).decode())
    assert signal.pending == 2
    assert abs(signal.last_request_time - metrics.last_request_time) < 1e-3
    assert decide(0, 0, signal).replicas == 1
    with pytest.raises(ValueError, match="not a quire router"):
        router_signal_from_metrics("up 1\n")


def test_cold_start_is_the_decision_to_the_first_token():
    cold = ColdStart(decided_at=100.0)
    assert cold_start_finished(cold, RouterSignal(1, 99.0, 50.0)) == cold  # an old first byte
    done = cold_start_finished(cold, RouterSignal(0, 120.0, 142.5))
    assert done.seconds == 42.5
    status = cold_start_status(done)
    assert status["seconds"] == 42.5 and "42.5s" in status["message"]
    assert cold_start_status(cold) == {"decidedAt": 100.0}


def test_with_lora_and_an_api_key_the_router_gets_the_key_to_read_the_replicas_models():
    def router_env(**spec):
        parsed = parse_spec({"router": {"enabled": True}, **spec})
        env = desired_router_deployment(OWNER, parsed.router, "quire:1")["spec"]["template"]["spec"][
            "containers"][0].get("env") or []
        return [e for e in env if e["name"] == "QUIRE_API_KEY"]  # the others: pod_security.py

    key = {"runtime": {"apiKeySecret": {"name": "chat-key"}}}
    assert router_env(adapters=[{"name": "sql", "source": "/m/sql"}], **key) == [
        {"name": "QUIRE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "chat-key", "key": "api-key"}}}]
    # Without LoRA the router never reads the replicas' models: no key.
    assert router_env(**key) == []
    assert router_env(adapters=[{"name": "sql", "source": "/m/sql"}]) == []
