"""Two nodes for real: `quire serve` on node 0 and `quire serve --headless` on node 1, each in
its own network namespace, joined by a veth pair, with vLLM's multi-node flags (--nnodes,
--node-rank, --master-addr, --master-port) and two pipeline stages, one per node. It serves
the single-process engine's greedy output; killing node 1 mid-stream ends the stream with an
error, fails /health and makes node 0 exit 1 within a bounded time, leaving no rank behind.
Start-up is bounded too: a node 0 whose other node never arrives names the missing ranks,
and a node that cannot reach node 0 says so; both exit 1."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from netns import LoopbackNodes, TwoNodes, unavailable_reason

from tp_helpers import ROOT, _load, wait_gone, worker_processes

harness = _load("server_harness", ROOT / "tests" / "server" / "server_harness.py")

FAILURE_BOUND_S = 60.0  # node 0 fails within this after node 1 dies
CLI = [sys.executable, "-m", "quire.entrypoints.cli", "serve"]


def _flags(master: str, port: int, node_rank: int) -> list[str]:
    return ["--dtype", "float32", "--kv-cache-memory", "16M", "--num-threads", "1",
            "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", str(node_rank),
            "--master-addr", master, "--master-port", str(port)]


def _free_master_port() -> int:
    """A free port whose step channel (rendezvous.step_port: the next one) is free too: node 0
    binds both, and the next port was sometimes another process's (EADDRINUSE)."""
    from quire.distributed.rendezvous import step_port
    while True:
        port = harness.free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", step_port(port)))
            except OSError:
                continue
        return port


def _log(name: str):
    return open(os.path.join(harness.tmp_root(), name), "w+")


def _tail(f) -> str:
    f.flush()
    f.seek(0)
    return "".join(f.readlines()[-40:])


@pytest.fixture
def two_nodes():
    reason = unavailable_reason()
    if reason is not None:
        print(f"no network namespaces ({reason}): the two nodes share this host's loopback")
    nodes = TwoNodes() if reason is None else LoopbackNodes()
    try:
        yield nodes
    finally:
        nodes.remove()


def test_two_nodes_serve_exactly_and_fail_fast_when_one_dies(two_nodes):
    from quire import LLM, SamplingParams
    model = harness.tiny_model()
    reference = LLM(model, dtype="float32", kv_cache_memory=16 << 20, num_threads=1)
    expected = reference.generate(["a b c d"], SamplingParams(temperature=0, max_tokens=12),
                                  use_tqdm=False)[0].outputs[0].text
    del reference
    master, port = two_nodes.addr[0], two_nodes.port
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "QUIRE_DISTRIBUTED_KEY": "test-key"}
    worker_log, leader_log = _log("node1.log"), _log("node0.log")
    worker = two_nodes.popen(1, [*CLI, model, *_flags(master, port, 1), "--headless"],
                             stdout=worker_log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    leader = two_nodes.popen(0, [*CLI, model, *_flags(master, port, 0), "--host", master,
                                 "--port", "8000"],
                             stdout=leader_log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://{master}:8000"
    ranks = []
    try:
        deadline = time.monotonic() + 180
        while two_nodes.http(0, "GET", url + "/ready", timeout=5)[0] != 200:
            assert leader.poll() is None, _tail(leader_log)
            assert time.monotonic() < deadline, _tail(leader_log) + _tail(worker_log)
            time.sleep(0.5)
        ranks = worker_processes(worker.pid)  # node 1's rank (pipeline stage 1)
        assert len(ranks) == 1, ranks
        assert "rank 1 of 2 joined" in _tail(worker_log)

        status, body = two_nodes.http(0, "POST", url + "/v1/completions", {
            "prompt": "a b c d", "max_tokens": 12, "temperature": 0})
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] == expected

        stream = two_nodes.stream(0, url + "/v1/completions", {
            "prompt": "e f g", "max_tokens": 1000, "ignore_eos": True, "stream": True})
        assert stream.stdout.readline().strip() == "200"
        assert next(line for line in stream.stdout if line.startswith("data: "))  # mid-run
        os.kill(worker.pid, signal.SIGKILL)  # node 1 goes away
        killed = time.monotonic()

        health = 200
        while health == 200 and time.monotonic() - killed < FAILURE_BOUND_S:
            health = two_nodes.http(0, "GET", url + "/health", timeout=5)[0]
            time.sleep(0.1)
        assert health != 200, "/health still 200"
        events = [json.loads(line[6:]) for line in stream.stdout
                  if line.startswith("data: ") and line.strip() != "data: [DONE]"]
        errors = [e["error"]["message"] for e in events if "error" in e]
        assert errors and "rank 1" in errors[0], events[-3:]
        code = leader.wait(timeout=max(1.0, FAILURE_BOUND_S - (time.monotonic() - killed)))
        noticed = time.monotonic() - killed
        print(f"node 0 exited {code} {noticed:.1f} s after node 1 was killed")
        assert code == 1, _tail(leader_log)
        assert "rank 1 on node 1 died" in _tail(leader_log)
        assert not wait_gone(ranks, timeout=30), "node 1's rank outlived its node"
    finally:
        for proc in (leader, worker):
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        wait_gone(ranks, timeout=30)


def test_node_zero_names_the_ranks_that_never_arrive():
    model = harness.tiny_model()
    port = _free_master_port()
    with _log("lonely-node0.log") as log:
        proc = subprocess.Popen(
            [*CLI, model, *_flags("127.0.0.1", port, 0), "--distributed-timeout", "3",
             "--tensor-parallel-size", "2", "--host", "127.0.0.1", "--port",
             str(harness.free_port())],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        assert proc.wait(timeout=120) == 1
        tail = _tail(log)
    # 2 x 2 ranks over 2 nodes: node 1's are ranks 2 and 3
    assert "2 of 2 remote ranks never arrived within 3 s: rank 2 (node 1), rank 3 (node 1)" \
        in tail, tail
    assert "--headless" in tail


def test_a_headless_node_that_cannot_reach_node_zero_says_so():
    model = harness.tiny_model()
    port = harness.free_port()  # nothing listens on the next one either
    with _log("lonely-node1.log") as log:
        proc = subprocess.Popen([*CLI, model, *_flags("127.0.0.1", port, 1), "--headless",
                                 "--distributed-timeout", "3"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        assert proc.wait(timeout=120) == 1
        tail = _tail(log)
    assert f"rank 1 could not reach node 0 at 127.0.0.1:{port + 1} within 3 s" in tail, tail


def test_nodes_whose_parallelism_flags_differ_both_say_so_at_once():
    """Node 1 runs tensor 2 (ranks 2 and 3) where node 0's group has tensor 1 (rank 1 only):
    node 0 refuses it, saying why to both sides, instead of waiting out
    --distributed-timeout while node 1 reports that node 0 went away."""
    model = harness.tiny_model()
    port = _free_master_port()
    with _log("mismatch-node0.log") as log0, _log("mismatch-node1.log") as log1:
        node0 = subprocess.Popen(
            [*CLI, model, *_flags("127.0.0.1", port, 0), "--distributed-timeout", "300",
             "--host", "127.0.0.1", "--port", str(harness.free_port())],
            stdout=log0, stderr=subprocess.STDOUT, cwd=ROOT)
        node1 = subprocess.Popen(
            [*CLI, model, *_flags("127.0.0.1", port, 1), "--tensor-parallel-size", "2",
             "--headless", "--distributed-timeout", "300"],
            stdout=log1, stderr=subprocess.STDOUT, cwd=ROOT)
        try:  # well within the 300 s timeout each would otherwise wait
            assert node0.wait(timeout=120) == 1 and node1.wait(timeout=120) == 1
        finally:
            for p in (node0, node1):
                if p.poll() is None:
                    p.kill()
        tail0, tail1 = _tail(log0), _tail(log1)
    # (node 1's ranks 2 and 3 race to say hello: whichever comes first is refused)
    assert re.search(r"the group cannot form: rank [23] is not one of this group's remote "
                     r"ranks \[1\]", tail0), tail0
    assert "--pipeline-parallel-size and --nnodes must be the same on every node" in tail0
    assert "refused rank" in tail1 and "must be the same on every node" in tail1, tail1


def test_a_node_with_another_model_is_refused_before_it_serves():
    """Node 1 holds a Qwen3 where node 0 serves a Llama: it loaded what matched node 0's
    layout (dropping the q/k norms) and the group answered with text neither model writes.
    Node 1 now compares its model's config with node 0's and stops, naming what differs; node
    0 then fails as when a node dies."""
    helpers = harness.runtime_helpers()
    from quire.models.loader import load_tokenizer, materialize, resolve_model
    other = os.path.join(harness.tmp_root(), "tiny-qwen3-other")
    if not os.path.exists(other):
        helpers.save_tiny_model(other, helpers.tiny_config("qwen3"),
                                load_tokenizer(materialize(resolve_model(None)), None))
    port = _free_master_port()
    with _log("othermodel-node0.log") as log0, _log("othermodel-node1.log") as log1:
        node0 = subprocess.Popen(
            [*CLI, harness.tiny_model(), *_flags("127.0.0.1", port, 0), "--distributed-timeout",
             "300", "--host", "127.0.0.1", "--port", str(harness.free_port())],
            stdout=log0, stderr=subprocess.STDOUT, cwd=ROOT)
        node1 = subprocess.Popen([*CLI, other, *_flags("127.0.0.1", port, 1), "--headless",
                                  "--distributed-timeout", "300"],
                                 stdout=log1, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            assert node1.wait(timeout=120) == 1 and node0.wait(timeout=180) == 1
        finally:
            for p in (node0, node1):
                if p.poll() is None:
                    p.kill()
        tail1 = _tail(log1)
    assert "this node's model" in tail1 and "is not node 0's: architecture" in tail1, tail1
    assert "every node must serve the same checkpoint" in tail1


def test_the_step_channel_finds_a_silent_peer():
    """Both ends of the step channel keep the kernel probing an idle peer and bound
    unacknowledged data, so a cut link ends the channel (node 0 fails its requests and exits;
    a headless node exits) instead of a wait without end."""
    import threading

    from quire.distributed import rendezvous
    port = harness.free_port()
    node0 = rendezvous.RemoteWorkers(port, [1], lambda rank: f"rank {rank}")
    joined = {}
    thread = threading.Thread(target=lambda: joined.update(
        worker=rendezvous.connect("127.0.0.1", port, 1, 10)))
    thread.start()
    conns = node0.accept_all(10, lambda rank: "spec")
    thread.join(10)
    worker, sent = joined["worker"]
    assert sent == "spec"
    try:
        for conn in (worker, conns[1]):
            with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as s:
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                idle, interval, count = rendezvous.KEEPALIVE
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == idle
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == interval
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == count
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == \
                    rendezvous.USER_TIMEOUT_MS
    finally:
        worker.close()
        conns[1].close()
        node0.close()
