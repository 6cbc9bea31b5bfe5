"""Processes for the router tests: fake replicas, real `quire serve` replicas, the router.

Every process binds a 127.0.0.x address, is started by the test that needs it and stopped by
PID when that test ends (a fixture or a `with`), and readiness is polled with a bounded wait,
never a sleep. Not a conftest.py (see tests/server/server_harness.py for why).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import requests
import urllib3

from child_processes import die_with_parent

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
START_TIMEOUT = 120.0


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate` until it returns something truthy (returned) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Proc:
    """A child process serving HTTP at `url`; `with Proc(...)` starts it and waits for
    `ready_path` to answer 200, and stops it (SIGTERM, then SIGKILL) on the way out."""

    def __init__(self, name: str, cmd: list[str], host: str, port: int,
                 ready_path: str = "/health", env: dict | None = None,
                 scheme: str = "http", verify: object = True,
                 cert: tuple[str, str] | None = None) -> None:
        self.name, self.cmd, self.ready_path = name, cmd, ready_path
        self.url = f"{scheme}://{host}:{port}"
        self.verify = verify  # requests' verify for an https:// process: a CA file
        self.cert = cert  # and a client certificate, if it requires one
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"quire-router-{name}-",
                                               suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = START_TIMEOUT) -> Proc:
        return self.launch().wait_ready(timeout)

    def launch(self) -> Proc:
        """Start the process without waiting (so several can load at once)."""
        self.proc = subprocess.Popen(die_with_parent(self.cmd), stdout=self.log,
                                     stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Proc:
        try:
            wait_until(self._ready, timeout, f"{self.name} at {self.url}", interval=0.1)
        except AssertionError as e:
            tail = self.log_tail()
            self.stop()
            raise AssertionError(f"{self.name} did not start ({e}):\n{tail}") from None
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n"
                                 f"{self.log_tail()}")
        try:
            with warnings.catch_warnings():  # verify=False: urllib3 would warn on every poll
                warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
                return requests.get(self.url + self.ready_path, timeout=2, verify=self.verify,
                                    cert=self.cert).status_code == 200
        except requests.RequestException:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        with_suppressed_unlink(self.log.name)

    def __enter__(self) -> Proc:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def with_suppressed_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@contextlib.contextmanager
def running_fakes(names: str, first_host: int):
    """Fake replicas named by the letters of `names` on 127.0.0.<first_host + i>, ready."""
    procs = {n: fake_backend(n, f"127.0.0.{first_host + i}") for i, n in enumerate(names)}
    try:
        for p in procs.values():
            p.launch()
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def reset_fakes(fakes: dict) -> dict:
    """Every fake replica back to idle, healthy, serving "fake", its request log cleared."""
    for p in fakes.values():
        requests.post(p.url + "/control", timeout=5,
                      json={"waiting": 0, "kv": 0.0, "status": 200, "seen": [], "models": ["fake"]})
    return fakes


def fake_backend(name: str, host: str, chunks: int = 5, interval: float = 0.05,
                 tls: tuple[str, str] | None = None) -> Proc:
    """`tls`: (certificate, key) files, for an HTTPS replica."""
    port = free_port(host)
    https = ["--ssl-certfile", tls[0], "--ssl-keyfile", tls[1]] if tls else []
    return Proc(f"fake-{name}", [sys.executable, str(HERE / "fake_backend.py"), "--host", host,
                                 "--port", str(port), "--name", name, "--chunks", str(chunks),
                                 "--interval", str(interval), *https], host, port,
                # Its readiness only: the certificate may name no address it listens on.
                scheme="https" if tls else "http", verify=not tls)


def router(*args: str, host: str = "127.0.0.20", ready_path: str = "/health",
           ca: str | None = None) -> Proc:
    """`ca`: the router serves HTTPS (its --ssl-* flags are in `args`); checked with this CA."""
    port = free_port(host)
    return Proc("router", [sys.executable, "-m", "quire.router", "--host", host, "--port",
                           str(port), "--scrape-interval", "0.2", *args], host, port, ready_path,
                scheme="https" if ca else "http", verify=ca or True)


def quire_serve(name: str, host: str, *args: str, ca: str | None = None,
                cert: tuple[str, str] | None = None) -> Proc:
    """`ca`: it serves HTTPS (its --ssl-* flags are in `args`), checked with this CA; `cert`:
    the client certificate its readiness polls present."""
    port = free_port(host)
    return Proc(f"serve-{name}", [sys.executable, "-m", "quire.entrypoints.cli", "serve", *args,
                                  "--host", host, "--port", str(port)], host, port, "/ready",
                scheme="https" if ca else "http", verify=ca or True, cert=cert)


class InProcessRouter:
    """The router's app under uvicorn in a thread of this process (no interpreter start, no
    second torch import: seconds saved per test on a loaded machine). `python -m quire.router`
    itself is started as a process by test_real_replicas.py."""

    def __init__(self, *args: str, host: str = "127.0.0.20") -> None:
        import argparse

        from quire.router.cli import add_router_arguments
        parser = argparse.ArgumentParser()
        add_router_arguments(parser)
        self.port = free_port(host)
        self.ns = parser.parse_args(["--host", host, "--port", str(self.port),
                                     "--scrape-interval", "0.2", *args])
        self.url = f"http://{host}:{self.port}"
        self.server = None
        self.thread = None

    def __enter__(self) -> InProcessRouter:
        import threading

        import uvicorn

        from quire.router.app import build_app
        from quire.router.cli import build_services, build_state
        state, background = build_state(self.ns)
        app = build_app(state, background, admin_api=self.ns.admin_api,
                        services=build_services(self.ns, state))
        config = uvicorn.Config(app, host=self.ns.host, port=self.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="router", daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 60, "the in-process router")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "the in-process router did not stop"


_server_harness = None


def server_harness():
    """tests/server/server_harness.py, loaded by path and only read (tiny_model, metrics_of)."""
    global _server_harness
    if _server_harness is None:
        spec = importlib.util.spec_from_file_location(
            "server_harness", ROOT / "tests" / "server" / "server_harness.py")
        _server_harness = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_server_harness)
    return _server_harness


def router_state(r: Proc) -> dict:
    return requests.get(r.url + "/router/state", timeout=5).json()


def sse_texts(response) -> list[dict]:
    """The JSON events of an SSE response, read as they come (`[DONE]` ends it)."""
    import json
    events = []
    for line in response.iter_lines():
        if not line or not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            events.append({"done": True})
            break
        events.append(json.loads(data))
    return events
