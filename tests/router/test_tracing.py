"""OpenTelemetry traces (`--otlp-traces-endpoint`): a live `quire serve` (tiny random Llama)
exports a span per generation request to a local OTLP receiver over gRPC, continuing the
client's W3C traceparent with the request's gen_ai attributes; `quire router` in front of it
exports its own span over OTLP/HTTP, child of the client's, and the replica's span is a child
of the router's."""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys

import pytest
import requests

from quire.router.cli import add_router_arguments
from quire.tracing import TracingUnavailable, start_tracing

from otlp_receiver import SPAN_KIND_SERVER, STATUS_ERROR, GrpcReceiver, HttpReceiver
from router_harness import ROOT, quire_serve, router, server_harness

# Spans leave the batch processor within 50 ms instead of 5 s.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def grpc_receiver():
    with GrpcReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def http_receiver():
    with HttpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def traced_server(grpc_receiver):
    tiny = server_harness().tiny_model()
    proc = quire_serve("traced", "127.0.0.41", tiny, "--dtype", "float32", "--kv-cache-memory",
                       "16M", "--num-threads", "1", "--served-model-name", "tiny",
                       "--otlp-traces-endpoint", grpc_receiver.url)
    proc.env.update(FAST_EXPORT)
    try:
        yield proc.start(300)
    finally:
        proc.stop()


def client_context() -> tuple[str, str, dict]:
    """A client span's ids and the traceparent header that carries them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


def server_span(receiver, trace_id: str, service: str = "quire"):
    return receiver.wait_for(lambda s: s.trace_id == trace_id and s.service == service,
                             f"{service}'s span in trace {trace_id}")


def test_a_completion_span_continues_the_clients_trace(traced_server, grpc_receiver):
    trace_id, span_id, headers = client_context()
    body = requests.post(traced_server.url + "/v1/completions", headers=headers, timeout=120,
                         json={"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 6,
                               "temperature": 0.5, "top_p": 0.9, "seed": 3}).json()
    span = server_span(grpc_receiver, trace_id)
    assert span.parent_span_id == span_id
    assert span.kind == SPAN_KIND_SERVER and span.name == "text_completion tiny"
    a = span.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.response.id"] == body["id"]
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == [body["choices"][0]["finish_reason"]]
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"],
            a["gen_ai.request.top_p"], a["gen_ai.request.seed"]) == (6, 0.5, 0.9, 3)
    assert a["http.response.status_code"] == 200
    latencies = {k.removeprefix("gen_ai.latency."): v for k, v in a.items()
                 if k.startswith("gen_ai.latency.")}
    assert set(latencies) == {"time_in_queue", "time_to_first_token", "e2e",
                              "time_in_model_prefill", "time_in_model_decode",
                              "time_in_model_inference"}
    assert 0 <= latencies["time_in_queue"] <= latencies["time_to_first_token"] <= latencies["e2e"]


def test_a_streamed_chat_span_counts_every_sample(traced_server, grpc_receiver):
    trace_id, span_id, headers = client_context()
    with requests.post(traced_server.url + "/v1/chat/completions", headers=headers, stream=True,
                       timeout=120,
                       json={"messages": [{"role": "user", "content": "hi"}], "n": 2,
                             "max_tokens": 5, "ignore_eos": True, "stream": True,
                             "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith(b"data: {")]
    usage = events[-1]["usage"]
    span = server_span(grpc_receiver, trace_id)
    a = span.attributes
    assert span.parent_span_id == span_id and span.name == "chat tiny"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.n"] == 2
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 10
    assert a["gen_ai.response.finish_reasons"] == ["length", "length"]


def test_generate_and_refused_requests_get_spans_too(traced_server, grpc_receiver):
    trace_id, span_id, headers = client_context()
    r = requests.post(traced_server.url + "/generate", headers=headers, timeout=120,
                      json={"prompt": PROMPT_IDS, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    a = server_span(grpc_receiver, trace_id).attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.usage.input_tokens"],
            a["gen_ai.usage.output_tokens"]) == ("text_completion", len(PROMPT_IDS), 3)

    trace_id, _, headers = client_context()
    r = requests.post(traced_server.url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": "no-such-model", "prompt": "x"})
    assert r.status_code == 404
    span = server_span(grpc_receiver, trace_id)
    assert span.attributes["http.response.status_code"] == 404
    assert "gen_ai.usage.input_tokens" not in span.attributes  # it never reached the engine
    assert span.status_code != STATUS_ERROR  # the client's mistake, not the server's


def test_the_router_span_sits_between_the_client_and_the_replica(traced_server, grpc_receiver,
                                                                  http_receiver):
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
           "OTEL_SERVICE_NAME": "edge-router"}
    proc = router("--routing", "round-robin", f"--backend={traced_server.url}",
                  "--otlp-traces-endpoint", http_receiver.url)  # no path: /v1/traces is added
    proc.env.update(env)
    with proc as r:
        trace_id, span_id, headers = client_context()
        body = requests.post(r.url + "/v1/completions", headers=headers, timeout=120,
                             json={"prompt": PROMPT_IDS, "max_tokens": 2}).json()
        assert body["usage"]["prompt_tokens"] == len(PROMPT_IDS)
        router_span = server_span(http_receiver, trace_id, "edge-router")
        replica_span = server_span(grpc_receiver, trace_id)
    assert router_span.parent_span_id == span_id
    assert router_span.name == "POST /v1/completions"
    assert router_span.attributes["http.response.status_code"] == 200
    assert replica_span.parent_span_id == router_span.span_id
    assert replica_span.attributes["gen_ai.usage.output_tokens"] == \
        body["usage"]["completion_tokens"]

    # No traceparent from the client: the router starts the trace, the replica continues it.
    proc = router("--routing", "round-robin", f"--backend={traced_server.url}",
                  "--otlp-traces-endpoint", http_receiver.url)
    proc.env.update(env)
    with proc as r:
        body = requests.post(r.url + "/v1/completions", timeout=120,
                             json={"prompt": PROMPT_IDS, "max_tokens": 1}).json()
        replica_span = grpc_receiver.wait_for(
            lambda s: s.attributes.get("gen_ai.response.id") == body["id"], "the replica span")
        router_span = server_span(http_receiver, replica_span.trace_id, "edge-router")
    assert router_span.parent_span_id == ""
    assert replica_span.parent_span_id == router_span.span_id


def test_without_an_endpoint_the_sdk_is_never_imported():
    code = ("import sys\n"
            "from quire.entrypoints.cli import build_parser\n"
            "from quire.entrypoints.api_server import build_app\n"
            "from quire.router.app import build_app as build_router_app\n"
            "from quire.tracing import start_tracing\n"
            "ns = build_parser().parse_args(['serve'])\n"
            "assert start_tracing(ns.otlp_traces_endpoint, 'quire') is None\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
            "'opentelemetry.exporter'))))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("args, env, message", [
    (["--otlp-traces-endpoint", "ftp://collector:4317"], {}, "--otlp-traces-endpoint"),
    (["--otlp-traces-endpoint", "grpc://collector:4317"],
     {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, "http://, https://"),
    ([], {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317",
          "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "grpc, http/protobuf"),
])
def test_bad_tracing_settings_are_refused_naming_them(args, env, message):
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    ns = parser.parse_args(args)
    with pytest.raises(TracingUnavailable, match=re.escape(message)):
        start_tracing(ns.otlp_traces_endpoint, "quire-router", environ=env)
