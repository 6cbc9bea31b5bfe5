"""The suite leaves no process behind (issue 49, item 8): a run whose tests leave a child
alive fails at its end, naming it, and the child is ended; processes shared by a worker's
tests (the live servers) end with the worker's session, and with the worker if it dies."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from concurrent import futures
from pathlib import Path

import grpc
import psutil

from child_processes import die_with_parent

ROOT = Path(__file__).resolve().parents[2]

LEAKY = """
import os, subprocess, sys
def test_starts_a_child_and_forgets_it():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open(os.environ["PID_FILE"], "w").write(str(p.pid))
"""

SHARED = """
import os, subprocess, sys
from child_processes import die_with_parent, share

class Server:
    def __init__(self):
        self.proc = subprocess.Popen(
            die_with_parent([sys.executable, "-c", "import time; time.sleep(300)"]))
    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)

def test_shares_a_server():
    s = Server()
    share(s)
    open(os.environ["PID_FILE"], "w").write(str(s.proc.pid))
"""

CRASHING_WORKER = """
import os, subprocess, sys
from child_processes import die_with_parent

def test_worker_dies_with_a_server_running():
    p = subprocess.Popen(die_with_parent([sys.executable, "-c", "import time; time.sleep(300)"]))
    open(os.environ["PID_FILE"], "w").write(str(p.pid))
    os._exit(3)  # as a worker that is killed: no fixture, no atexit handler runs
"""


def _run(tmp_path: Path, source: str, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    """pytest on one test file under the suite's conftest.py and settings."""
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (folder / "test_it.py").write_text(textwrap.dedent(source))
    env = {**os.environ, "QUIRE_TEST_SURVIVOR_GRACE": "2", "PID_FILE": str(tmp_path / "pid"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "server"),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:kmock",
         "--basetemp", str(tmp_path / "base"), *args, str(folder)],
        capture_output=True, text=True, timeout=240, env=env, cwd=folder)
    pid = int((tmp_path / "pid").read_text())
    return done, pid


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_run_that_leaves_a_child_behind_fails_and_names_it(tmp_path):
    done, pid = _run(tmp_path, LEAKY)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 passed" in out and "outlived it" in out and f"pid {pid}" in out, out
    assert _gone_within(pid, 10), "the leftover child was not ended"


def test_a_server_shared_by_a_workers_tests_ends_with_its_session(tmp_path):
    done, pid = _run(tmp_path, SHARED, "-n", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not _alive(pid)


def test_a_server_ends_with_a_worker_that_dies(tmp_path):
    done, pid = _run(tmp_path, CRASHING_WORKER, "-n", "1", "--max-worker-restart", "0")
    assert _gone_within(pid, 10), "the dead worker's server is still running"
    assert "outlived it" not in done.stdout + done.stderr


def test_children_start_beside_a_grpc_server():
    """A test process holding a gRPC server (the OTLP receiver) starts its children cleanly.
    With prctl in a Popen preexec_fn, Python ran gRPC's at-fork handlers in the forked child
    and about 1 child in 100 aborted before exec (epoll_wait: Bad file descriptor): 300
    starts failed at least once in nearly every run."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")  # the client side's poller too
    try:
        failed = []
        for _ in range(300):
            child = subprocess.run(die_with_parent(["true"]), capture_output=True, text=True,
                                   timeout=30)
            if child.returncode != 0 or child.stderr:
                failed.append((child.returncode, child.stderr[:200]))
        assert not failed, failed
    finally:
        channel.close()
        server.stop(grace=None)
