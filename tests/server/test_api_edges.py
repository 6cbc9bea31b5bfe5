"""Smaller edges of the HTTP API and `quire serve` (issue 49, item 5), through the official
openai client where one is involved: models.retrieve, stop_token_ids outside the vocabulary,
a lone surrogate, text_offset past skipped special tokens, a body that is not JSON, a port in
use, a truncated GGUF, and a failed load's one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import openai
import pytest
import requests

from quire.entrypoints.logprobs import completion_logprobs
from quire.outputs import CompletionOutput, Logprob

from server_harness import ROOT, SMOLLM_NAME, free_port, openai_client, server, tmp_root

C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
BODIES = {C: {"prompt": "hi", "max_tokens": 2},
          CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          GEN: {"prompt": "hi", "max_tokens": 2}}


@pytest.fixture(scope="module")
def smollm():
    return server("smollm")


def test_models_retrieve_answers_each_listed_model(smollm):
    client = openai_client(smollm)
    listed = [m.id for m in client.models.list().data]
    for name in listed:
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("path", BODIES)
def test_stop_token_ids_outside_the_vocabulary_are_400(smollm, path):
    r = requests.post(smollm.url + path, timeout=60,
                      json={**BODIES[path], "stop_token_ids": [10**12]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stop_token_ids" and "vocabulary" in err["message"]


def test_a_lone_surrogate_is_named_as_such(smollm):
    r = requests.post(smollm.url + C, data=b'{"prompt": "\\ud800", "max_tokens": 2}',
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400
    assert "lone UTF-16 surrogate" in r.json()["error"]["message"]
    paired = requests.post(smollm.url + C, data=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}',
                           headers={"Content-Type": "application/json"}, timeout=60)
    assert paired.status_code == 200, paired.text


@pytest.mark.parametrize("path", BODIES)
def test_a_body_not_declared_as_json_is_415(smollm, path):
    import json
    r = requests.post(smollm.url + path, data=json.dumps(BODIES[path]), timeout=60,
                      headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.text
    assert "application/json" in r.json()["error"]["message"]


def test_text_offset_does_not_count_skipped_special_tokens():
    eos = 2
    entry = {eos: Logprob(-0.1, 1, "<|endoftext|>")}
    out = CompletionOutput(0, "", [eos, eos, eos, eos], None,
                           logprobs=[entry] * 4, finish_reason="length")
    assert completion_logprobs(out, 0, 0, frozenset({eos})).text_offset == [0, 0, 0, 0]
    a, b = {5: Logprob(-1.0, 1, "ab")}, {6: Logprob(-1.0, 1, "cd")}
    out = CompletionOutput(0, "abcd", [5, eos, 6], None, logprobs=[a, entry, b])
    assert completion_logprobs(out, 0, 3, frozenset({eos})).text_offset == [3, 5, 5]


def test_text_offsets_index_the_text(smollm):
    client = openai_client(smollm)
    r = client.completions.create(model=SMOLLM_NAME, prompt="The capital of France is",
                                  max_tokens=12, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    for tok, offset in zip(choice.logprobs.tokens, choice.logprobs.text_offset):
        assert offset <= len(choice.text)
        if tok not in ("<|endoftext|>", "<|im_end|>"):
            assert choice.text[offset:offset + len(tok)] == tok


def _quire_serve(*args: str, log_level: str = "info") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quire.entrypoints.cli", "--log-level",
                           log_level, "serve", *args, "--num-threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_a_port_in_use_fails_at_once_with_one_line():
    from server_harness import tiny_model
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _quire_serve(tiny_model(), "--host", "127.0.0.1", "--port", str(port))
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert out.strip().splitlines()[-1].startswith(f"quire: error: cannot listen on "
                                                   f"127.0.0.1:{port}"), out
    assert "engine ready" not in out and "Traceback" not in out


def test_a_truncated_gguf_says_so_in_one_line():
    from quire.models.loader import resolve_model
    source = resolve_model(None).path  # the default model's GGUF file
    path = os.path.join(tmp_root(), "truncated.gguf")
    with open(source, "rb") as f, open(path, "wb") as out:
        out.write(f.read(os.path.getsize(source) // 3))
    done = _quire_serve(path, "--host", "127.0.0.1", "--port", str(free_port()))
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    last = out.strip().splitlines()[-1]
    assert "exiting with status 1" in last and "truncated (" in last, out
    assert f"of {os.path.getsize(source)} bytes)" in last
    assert "Traceback" not in out
    debug = _quire_serve(path, "--host", "127.0.0.1", "--port", str(free_port()),
                         log_level="debug")
    assert "Traceback" in debug.stdout + debug.stderr  # kept for --log-level debug
