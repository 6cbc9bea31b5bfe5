"""The servers a benchmark starts: a free port, waiting until one is ready, stopping it
(SIGTERM, a clean shutdown, then SIGKILL)."""

from __future__ import annotations

import compileall
import io
import os
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int:
    """The status GET `url` answers with; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def wait_ready(proc: subprocess.Popen, url: str, timeout: float = 600.0) -> None:
    """Quire: /ready (its /health answers while the model loads); llama-server, which has no
    /ready: /health (503 until loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        ready = http_status(url + "/ready")
        if ready == 200 or (ready == 404 and http_status(url + "/health") == 200):
            return
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Ask `proc` to exit; kill it if it has not within `timeout` seconds; reap it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def runtime_snapshot(revision: str) -> str:
    """The `runtime` folder of a git revision of this checkout, extracted into a temporary
    folder: put it on PYTHONPATH to run that revision's engine beside this one's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    snapshot = tempfile.mkdtemp(prefix="quire-baseline-")
    archive = subprocess.run(["git", "-C", root, "archive", revision, "runtime"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(snapshot)
    # byte-compiled like this checkout, so that a start-up under PYTHONDONTWRITEBYTECODE does
    # not compile the older sources every time
    compileall.compile_dir(os.path.join(snapshot, "runtime"), quiet=1)
    return os.path.join(snapshot, "runtime")
