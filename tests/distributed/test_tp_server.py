"""`quire serve --tensor-parallel-size 2`: serves, and when a worker dies mid-stream the
client gets an error, /ready fails, the server exits non-zero and leaves no worker behind."""

from __future__ import annotations

import json
import os
import signal
import time

import requests

from tp_helpers import ROOT, TP, _load, wait_gone, worker_processes

harness = _load("server_harness", ROOT / "tests" / "server" / "server_harness.py")


def test_a_dead_worker_makes_ready_fail_and_the_server_exit_nonzero():
    srv = harness.ServerProcess("tp2", [
        harness.tiny_model(), "--dtype", "float32", "--kv-cache-memory", "16M",
        "--num-threads", "1", "--tensor-parallel-size", str(TP)])
    srv.start()
    try:
        srv.wait_ready(harness.READY_TIMEOUT)
        [worker] = worker_processes(srv.proc.pid)
        ok = requests.post(srv.url + "/v1/completions", timeout=120,
                           json={"prompt": "a b c", "max_tokens": 8, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8

        stream = requests.post(srv.url + "/v1/completions", stream=True, timeout=120, json={
            "prompt": "d e f", "max_tokens": 1000, "ignore_eos": True, "stream": True})
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))  # mid-run
        os.kill(worker, signal.SIGKILL)

        answers, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                answers.append(requests.get(srv.url + "/ready", timeout=5).status_code)
            except requests.RequestException:
                answers.append(None)  # already exited
            if answers[-1] != 200:
                break
            time.sleep(0.05)
        assert answers[-1] == 503, f"/ready never failed: {answers[-5:]}\n{srv.log_tail()}"

        events = [json.loads(line[6:]) for line in lines
                  if line.startswith(b"data: ") and line != b"data: [DONE]"]
        errors = [e["error"]["message"] for e in events if "error" in e]
        assert errors and "rank 1" in errors[0], events[-3:]
        assert srv.wait_exit(timeout=60) == 1
        assert not wait_gone([worker], timeout=30)
        assert "died" in srv.log_tail(200)
    finally:
        srv.stop()
