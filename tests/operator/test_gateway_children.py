"""spec.gateway as pure functions: the InferencePool and HTTPRoute the operator writes are valid
against the vendored upstream CRDs, select the serving pods and name the router as their
endpoint picker; the runtime gets vLLM's metric names; bad specs name their field."""

import copy

import crd_rules
import pytest
import yaml
from foreign_crds import problems

from quire_operator import names
from quire_operator.children import desired_deployment
from quire_operator.gateway_children import (
    desired_http_route,
    desired_inference_objectives,
    desired_inference_pool,
    gateway_children,
)
from quire_operator.pod_template import server_args
from quire_operator.router_children import desired_router_deployment, desired_router_service
from quire_operator.spec import SpecError, parse_spec

from operator_harness import CRD_PATH

OWNER = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "chat", "namespace": "llm", "uid": "u-1"}}
GATEWAYS = [{"name": "inference-gateway", "namespace": "gateways"},
            {"name": "internal", "sectionName": "http"}]
SPEC = {"port": 9000, "router": {"enabled": True},
        "gateway": {"inferencePool": {"enabled": True},
                    "httpRoute": {"parentRefs": GATEWAYS, "hostnames": ["llm.example.com"]}}}
LLMD_CRD = yaml.safe_load(CRD_PATH.read_text())


def test_the_pool_selects_the_serving_pods_and_names_the_router_as_endpoint_picker():
    spec = parse_spec(SPEC)
    pool = desired_inference_pool(OWNER, spec)
    assert problems(pool) == []
    deployment = desired_deployment(OWNER, spec, "img")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    # Exactly the runtime Deployment's pods: its own selector, which the router pods never match.
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 9000}]
    # The endpoint picker: the Service in front of the router pods, on its ext_proc port.
    picker = pool["spec"]["endpointPickerRef"]
    service = desired_router_service(OWNER, spec.router)
    assert (picker["kind"], picker["name"]) == ("Service", service["metadata"]["name"])
    assert {"name": "grpc-ext-proc", "port": 9002, "targetPort": "grpc-ext-proc",
            "protocol": "TCP"} in service["spec"]["ports"]
    assert picker["port"] == {"number": 9002} and picker["failureMode"] == "FailClose"
    (container,) = desired_router_deployment(OWNER, spec.router, "img")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--ext-proc-port") + 1] == "9002"
    assert {"name": "grpc-ext-proc", "containerPort": 9002, "protocol": "TCP"} in container["ports"]
    (ref,) = pool["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["controller"]) == ("LLMDeployment", "chat", True)


def test_the_route_sends_the_gateways_traffic_to_the_pool():
    route = desired_http_route(OWNER, parse_spec(SPEC))
    assert problems(route) == []
    assert route["spec"]["parentRefs"] == GATEWAYS
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": "chat"}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["timeouts"] == {"request": "300s"}


def test_without_parent_refs_there_is_a_pool_and_no_route():
    spec = parse_spec({**SPEC, "gateway": {"inferencePool": {"enabled": True, "failureMode": "FailOpen"}}})
    assert desired_http_route(OWNER, spec) is None
    pool = desired_inference_pool(OWNER, spec)
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen" and problems(pool) == []


def test_the_pools_switch_turns_its_route_off_too():
    spec = parse_spec({"router": {"enabled": True}, "gateway": {
        "inferencePool": {"enabled": False}, "httpRoute": {"parentRefs": GATEWAYS}}})
    assert desired_inference_pool(OWNER, spec) is None and desired_http_route(OWNER, spec) is None


def test_nothing_without_the_pool_and_the_router_keeps_its_plain_ports():
    spec = parse_spec({"router": {"enabled": True}})
    assert desired_inference_pool(OWNER, spec) is None and desired_http_route(OWNER, spec) is None
    assert [p["name"] for p in desired_router_service(OWNER, spec.router)["spec"]["ports"]] == ["http"]
    (container,) = desired_router_deployment(OWNER, spec.router, "img")["spec"]["template"]["spec"]["containers"]
    assert "--ext-proc-port" not in container["args"]
    assert "--metrics-compat" not in server_args(spec)


@pytest.mark.parametrize("extra, expected", [
    ([], ["--metrics-compat", "vllm"]),
    (["--metrics-compat", "vllm"], ["--metrics-compat", "vllm"]),  # not twice
    (["--metrics-compat=vllm"], ["--metrics-compat=vllm"]),
])
def test_the_pool_gives_the_runtime_vllms_metric_names(extra, expected):
    spec = parse_spec({**SPEC, "runtime": {"extraArgs": extra}})
    args = server_args(spec)
    assert [a for a in args if a.startswith("--metrics-compat")] == [expected[0]]
    assert args[args.index(expected[0]):][:len(expected)] == expected


def _llmd(spec):
    return {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": "chat"},
            "spec": copy.deepcopy(spec)}


@pytest.mark.parametrize("spec, field, crd_says", [
    ({"gateway": {"inferencePool": {"enabled": True}}},
     "spec.gateway.inferencePool.enabled", "needs router.enabled"),
    ({**SPEC, "gateway": {"inferencePool": {"enabled": True, "failureMode": "Retry"}}},
     "spec.gateway.inferencePool.failureMode", "is not one of"),
    ({**SPEC, "gateway": {**SPEC["gateway"], "httpRoute": {"parentRefs": [{"namespace": "gw"}]}}},
     "spec.gateway.httpRoute.parentRefs[0].name", "'name' is a required property"),
    ({**SPEC, "gateway": {**SPEC["gateway"], "httpRoute": {"parentRefs": GATEWAYS, "requestTimeout": "5 min"}}},
     "spec.gateway.httpRoute.requestTimeout", "does not match"),
    ({**SPEC, "gateway": {**SPEC["gateway"], "httpRoute": {"parentRefs": GATEWAYS, "hostnames": ["10.0.0.1:80"]}}},
     "spec.gateway.httpRoute.hostnames[0]", "does not match"),
    ({"router": {"enabled": True}, "gateway": {"objectives": [{"name": "chat", "priority": 1}]}},
     "spec.gateway.objectives", "objectives need inferencePool.enabled"),
    ({**SPEC, "gateway": {**SPEC["gateway"], "objectives": [{"name": "chat", "priority": "high"}]}},
     "spec.gateway.objectives[0].priority", "is not of type 'integer'"),
    ({**SPEC, "gateway": {**SPEC["gateway"], "objectives": [{"name": "Chat!", "priority": 1}]}},
     "spec.gateway.objectives[0].name", "does not match"),
    ({**SPEC, "gateway": {**SPEC["gateway"], "objectives": [{"name": "chat", "priority": 2 ** 31}]}},
     "spec.gateway.objectives[0].priority", "is greater than the maximum"),
])
def test_bad_gateway_specs_are_refused_naming_the_field(spec, field, crd_says):
    with pytest.raises(SpecError) as refused:
        parse_spec(spec)
    assert refused.value.field == field
    # The CRD refuses them at `kubectl apply` already.
    found = crd_rules.violations(_llmd(spec), LLMD_CRD)
    assert found and crd_says in found[0], found


def test_the_crd_accepts_a_whole_gateway_spec():
    assert crd_rules.violations(_llmd(SPEC), LLMD_CRD) == []


# The validator stands in for the API server: it must refuse what the real CRDs refuse.
@pytest.mark.parametrize("change, said", [
    (lambda p: p["spec"]["endpointPickerRef"].pop("port"), "port is required when kind is 'Service'"),
    (lambda p: p["spec"].update(targetPorts=[{"number": 80}, {"number": 80}]), "port number must be unique"),
    (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Retry"), "is not one of"),
    (lambda p: p["spec"].update(targetPort=80), "spec.targetPort: unknown field"),
    (lambda p: p["spec"].pop("selector"), "'selector' is a required property"),
])
def test_the_vendored_pool_schema_refuses_broken_pools(change, said):
    pool = desired_inference_pool(OWNER, parse_spec(SPEC))
    change(pool)
    found = problems(pool)
    assert found and said in found[0], found


@pytest.mark.parametrize("change, said", [
    (lambda r: r["spec"]["rules"][0]["backendRefs"][0].update(group="", kind="Service"),
     "Must have port for Service reference"),
    (lambda r: r["spec"]["rules"][0]["matches"][0]["path"].update(value="v1"), "must be an absolute path"),
    (lambda r: r["spec"]["rules"][0]["timeouts"].update(backendRequest="10m"), "cannot be longer than request"),
    (lambda r: r["spec"]["parentRefs"][0].update(namespace="Gateways"), "does not match"),
])
def test_the_vendored_route_schema_refuses_broken_routes(change, said):
    route = desired_http_route(OWNER, parse_spec(SPEC))
    change(route)
    found = problems(route)
    assert found and said in found[0], found


def test_the_names_the_pool_uses_are_the_operators():
    pool = desired_inference_pool(OWNER, parse_spec(SPEC))
    assert pool["spec"]["selector"]["matchLabels"] == {names.SELECTOR_LABEL: "chat"}
    assert pool["metadata"]["labels"][names.MANAGED_BY_LABEL] == names.MANAGED_BY


def test_objectives_become_inference_objectives_on_the_pool_and_router_flags():
    objectives = [{"name": "chat", "priority": 10}, {"name": "batch", "priority": -1},
                  {"name": "default-ish"}]
    spec = parse_spec({**SPEC, "gateway": {**SPEC["gateway"], "objectives": objectives}})
    written = desired_inference_objectives(OWNER, spec)
    assert [problems(o) for o in written] == [[], [], []]
    assert [(o["metadata"]["name"], o["spec"]["priority"]) for o in written] == \
        [("chat", 10), ("batch", -1), ("default-ish", 0)]
    for o in written:
        assert o["spec"]["poolRef"] == {"group": "inference.networking.k8s.io",
                                        "kind": "InferencePool", "name": "chat"}
        assert o["metadata"]["labels"] == names.child_labels("chat")
        (ref,) = o["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"]) == ("LLMDeployment", "chat")
    # after the pool they name, in apply order
    assert [c["kind"] for c in gateway_children(OWNER, spec)] == \
        ["InferencePool", "HTTPRoute", "InferenceObjective", "InferenceObjective", "InferenceObjective"]
    # the router's flow control weighs requests by the same priorities
    (container,) = desired_router_deployment(OWNER, spec.router, "img")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--objective"] == \
        ["chat=10", "batch=-1", "default-ish=0"]
    assert crd_rules.violations(_llmd({**SPEC, "gateway": {**SPEC["gateway"], "objectives": objectives}}),
                                LLMD_CRD) == []
    with pytest.raises(SpecError, match="listed twice"):
        parse_spec({**SPEC, "gateway": {**SPEC["gateway"], "objectives": [{"name": "a"}, {"name": "a"}]}})
