"""Schemathesis against a live `quire serve` and a live `quire router` (issue 49, item 4):
/openapi.json documents every request body, answer and error, and a fuzzer that reads it
finds no 5xx, no answer outside the declared schema (status, media type, body), and leaves
the server alive. Bounded: a fixed number of examples per operation, with max_tokens and n
capped in the schema the fuzzer reads (the server's own schema leaves them open)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from server_harness import ServerProcess, tiny_model

MAX_EXAMPLES = 6  # per operation (24 operations: the suite stays bounded)
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance")
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "min_tokens": 4, "top_logprobs": 2,
        "logprobs": 2}
ROUTER_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize",
                "/detokenize", "/v1/models", "/v1/models/{model_id}")


@pytest.fixture(scope="module")
def srv():
    # a short context: a body without max_tokens generates to the context's end (the random
    # model rarely samples EOS), and at the model's 1,024 the fuzz ran ~1,000 tokens a request
    s = ServerProcess("fuzzed", [tiny_model(), "--dtype", "float32", "--kv-cache-memory", "16M",
                                 "--num-threads", "1", "--max-num-seqs", "4",
                                 "--max-model-len", "64"])
    s.start()
    try:
        s.wait_ready(300)
        yield s
    finally:
        s.stop()


def _bounded(schema: dict, paths: tuple[str, ...] | None = None) -> dict:
    """The server's schema with CAPS as maxima of the request bodies' fields (an answer may
    echo a request's out-of-cap value: the fuzzer sends some, which the server accepts), and
    only `paths`, when given."""
    bodies = {content["schema"]["$ref"].rsplit("/", 1)[-1]
              for ops in schema["paths"].values() for op in ops.values()
              for content in op.get("requestBody", {}).get("content", {}).values()
              if "$ref" in content.get("schema", {})}
    for name, model in schema["components"]["schemas"].items():
        if name not in bodies:
            continue
        for field, cap in CAPS.items():
            prop = model.get("properties", {}).get(field)
            if prop is None:
                continue
            for variant in prop.get("anyOf", [prop]):
                if variant.get("type") == "integer":
                    variant["maximum"] = cap
    if paths is not None:
        schema["paths"] = {p: ops for p, ops in schema["paths"].items() if p in paths}
    return schema


def _fuzz(tmp_path: Path, schema: dict, base_url: str) -> subprocess.CompletedProcess:
    path = tmp_path / "openapi.json"
    path.write_text(json.dumps(schema))
    st = Path(sys.executable).with_name("st")
    return subprocess.run(
        [str(st), "run", str(path), "--url", base_url, "--checks", CHECKS,
         "--max-examples", str(MAX_EXAMPLES), "--seed", "49", "--request-timeout", "120",
         "--phases", "examples,coverage,fuzzing", "--generation-deterministic", "--no-color"],
        capture_output=True, text=True, timeout=1500, cwd=tmp_path,
        env={**os.environ, "SCHEMATHESIS_HOOKS": ""})


def _operations(schema: dict) -> int:
    return sum(len(ops) for ops in schema["paths"].values())


def _documented(schema: dict) -> None:
    for path, method in (("/v1/completions", "post"), ("/v1/chat/completions", "post"),
                         ("/generate", "post")):
        op = schema["paths"][path][method]
        assert "requestBody" in op, path
        assert {"400", "404", "415", "500", "503"} <= set(op["responses"]), path
        assert len(op["responses"]["200"]["content"]) == 2, path  # JSON and the stream
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]


def test_quire_serve_survives_the_fuzzer_within_its_schema(srv, tmp_path):
    schema = requests.get(srv.url + "/openapi.json", timeout=30).json()
    _documented(schema)
    done = _fuzz(tmp_path, _bounded(schema), srv.url)
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-3000:]
    assert f"Tested: {_operations(schema)}" in done.stdout, done.stdout[-3000:]
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    assert requests.get(srv.url + "/ready", timeout=10).status_code == 200
    assert srv.proc.poll() is None


def test_quire_router_survives_the_fuzzer_within_its_replicas_schema(srv, tmp_path):
    from router_harness import router
    schema = _bounded(requests.get(srv.url + "/openapi.json", timeout=30).json(), ROUTER_PATHS)
    with router("--backend", srv.url) as r:
        # what the fuzzer first found: a control character in a proxied path was a 500
        odd = requests.get(r.url + "/v1/models/%C3%B2%15j", timeout=30)
        assert odd.status_code == 404, odd.text
        done = _fuzz(tmp_path, schema, r.url)
        assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-3000:]
        assert f"Tested: {_operations(schema)}" in done.stdout, done.stdout[-3000:]
        assert requests.get(r.url + "/health", timeout=10).status_code == 200
        assert r.alive()
    assert requests.get(srv.url + "/ready", timeout=10).status_code == 200
