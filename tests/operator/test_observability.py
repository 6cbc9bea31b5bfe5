"""spec.observability as pure functions: an OTLP endpoint reaches the runtime pods and the
router as the flag their own CLIs read (with the protocol and a service name per component,
unless spec.env says otherwise); bad endpoints and protocols name their field, in the CRD and in
the operator alike."""

import argparse
import copy

import crd_rules
import pytest
import yaml

from quire.entrypoints.cli import build_parser
from quire.router.cli import add_router_arguments
from quire_operator.children import desired_deployment
from quire_operator.observability_spec import ENDPOINT
from quire_operator.router_children import desired_router_deployment
from quire_operator.spec import SpecError, parse_spec

from operator_harness import CRD_PATH

OWNER = {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment",
         "metadata": {"name": "chat", "namespace": "llm", "uid": "u-1"}}
COLLECTOR = "http://otel-collector.observability:4317"
SPEC = {"router": {"enabled": True}, "observability": {"otlpEndpoint": COLLECTOR}}
LLMD_CRD = yaml.safe_load(CRD_PATH.read_text())


def runtime_container(spec: dict) -> dict:
    (container,) = desired_deployment(OWNER, parse_spec(spec), "img")["spec"]["template"]["spec"]["containers"]
    return container


def router_container(spec: dict) -> dict:
    deployment = desired_router_deployment(OWNER, parse_spec(spec).router, "img")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_endpoint_reaches_the_runtime_and_the_router_as_their_flag():
    runtime = runtime_container(SPEC)
    ns = build_parser().parse_args(runtime["args"])  # what `quire serve` reads from the pod's args
    assert ns.otlp_traces_endpoint == COLLECTOR
    assert env_of(runtime)["OTEL_SERVICE_NAME"] == "chat"
    assert env_of(runtime)["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"

    router = router_container(SPEC)
    assert router["args"][0] == "router"
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    assert parser.parse_args(router["args"][1:]).otlp_traces_endpoint == COLLECTOR
    assert env_of(router)["OTEL_SERVICE_NAME"] == "chat-router"


def test_the_protocol_and_a_users_own_settings():
    spec = {**SPEC, "observability": {"otlpEndpoint": "https://collector:4318", "otlpProtocol": "http/protobuf"},
            "env": [{"name": "OTEL_SERVICE_NAME", "value": "chatbot-prod"}]}
    env = runtime_container(spec)["env"]
    assert [e for e in env if e["name"] == "OTEL_SERVICE_NAME"] == [{"name": "OTEL_SERVICE_NAME",
                                                                     "value": "chatbot-prod"}]
    assert env_of(runtime_container(spec))["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert env_of(router_container(spec))["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"


def test_without_an_endpoint_nothing_changes_in_the_pods():
    spec = {"router": {"enabled": True}}
    for container in (runtime_container(spec), router_container(spec)):
        assert "--otlp-traces-endpoint" not in container["args"]
        assert not any(name.startswith("OTEL_") for name in env_of(container))
    # An empty section is the same spec: no pod rolls for it.
    assert runtime_container({**spec, "observability": {}}) == runtime_container(spec)


def _llmd(spec):
    return {"apiVersion": "quire.dev/v1alpha1", "kind": "LLMDeployment", "metadata": {"name": "chat"},
            "spec": copy.deepcopy(spec)}


@pytest.mark.parametrize("observability, field, crd_says", [
    ({"otlpEndpoint": "otel-collector:4317"}, "spec.observability.otlpEndpoint", "does not match"),
    ({"otlpEndpoint": "grpc://otel-collector:4317"}, "spec.observability.otlpEndpoint", "does not match"),
    ({"otlpEndpoint": "http:// collector"}, "spec.observability.otlpEndpoint", "does not match"),
    ({"otlpEndpoint": COLLECTOR, "otlpProtocol": "http/json"}, "spec.observability.otlpProtocol",
     "is not one of"),
])
def test_bad_observability_specs_are_refused_naming_the_field(observability, field, crd_says):
    spec = {"observability": observability}
    with pytest.raises(SpecError) as refused:
        parse_spec(spec)
    assert refused.value.field == field
    found = crd_rules.violations(_llmd(spec), LLMD_CRD)
    assert found and crd_says in found[0], found


def test_the_crd_and_the_operator_agree_on_the_endpoint():
    schema = crd_rules.schema_of(LLMD_CRD)["properties"]["spec"]["properties"]["observability"]
    assert schema["properties"]["otlpEndpoint"]["pattern"] == ENDPOINT.pattern
    assert crd_rules.violations(_llmd(SPEC), LLMD_CRD) == []
