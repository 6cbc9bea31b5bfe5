"""One serving pod for the end-to-end test, bound to its own loopback IP.

`start_runtime_pod` is the one place that decides what a pod is. By default it is `quire serve`
itself on the default model with `max_num_seqs` slots (a request past them waits, and counts in
quire:num_requests_waiting). With QUIRE_E2E_RUNTIME=stand-in it is a tiny HTTP server with the
same contract as the operator sees it (/health, /ready, /metrics with the documented gauge
names, /v1/completions that queues): seconds faster, for iterating on the operator. The test
loads pods only through HTTP.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from child_processes import die_with_parent

MODEL_NAME = "smollm2"
MAX_NUM_SEQS = 2  # requests generated at once; the rest wait
SECONDS_PER_REQUEST = 0.25  # time a request holds its slot
KV_BLOCKS = 64
BLOCKS_PER_SEQUENCE = 8


class FakeEngine:
    def __init__(self) -> None:
        self.slots = threading.Semaphore(MAX_NUM_SEQS)
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def complete(self, prompt: str, max_tokens: int) -> None:
        with self.lock:
            self.waiting += 1
        self.slots.acquire()
        with self.lock:
            self.waiting -= 1
            self.running += 1
        try:
            time.sleep(SECONDS_PER_REQUEST)
        finally:
            with self.lock:
                self.running -= 1
                self.prompt_tokens += len(prompt.split())
                self.generation_tokens += max_tokens
            self.slots.release()

    def metrics(self) -> str:
        with self.lock:
            used = self.running * BLOCKS_PER_SEQUENCE
            gauges = {
                "quire:num_requests_running": self.running,
                "quire:num_requests_waiting": self.waiting,
                "quire:num_requests_swapped": 0,
                "quire:kv_cache_usage_perc": used / KV_BLOCKS,
                "quire:kv_cache_blocks_total": KV_BLOCKS,
                "quire:kv_cache_blocks_used": used,
            }
            counters = {
                "quire:num_preemptions": 0,
                "quire:prompt_tokens": self.prompt_tokens,
                "quire:generation_tokens": self.generation_tokens,
            }
        lines = []
        for name, value in gauges.items():
            lines += [f"# HELP {name} {name}", f"# TYPE {name} gauge", f'{name}{{model_name="{MODEL_NAME}"}} {float(value)}']
        for name, value in counters.items():
            lines += [f"# HELP {name} {name}", f"# TYPE {name} counter",
                      f'{name}_total{{model_name="{MODEL_NAME}"}} {float(value)}']
        return "\n".join(lines) + "\n"


class FixedMetrics:
    """A pod whose gauges say what the test wants, however wrong (NaN, +Inf, negative)."""

    def __init__(self, waiting: float, kv_usage: float) -> None:
        self.waiting, self.kv_usage = waiting, kv_usage

    def metrics(self) -> str:
        def number(value: float) -> str:  # the Prometheus text format's spellings
            return "NaN" if value != value else "+Inf" if value == float("inf") else \
                "-Inf" if value == float("-inf") else repr(float(value))

        lines = []
        for name, value in (("quire:num_requests_waiting", self.waiting), ("quire:kv_cache_usage_perc", self.kv_usage)):
            lines += [f"# TYPE {name} gauge", f'{name}{{model_name="{MODEL_NAME}"}} {number(value)}']
        return "\n".join(lines) + "\n"


class FixedRouterMetrics:
    """A router stand-in: the figures the operator's scale-to-zero poll reads, as the test sets
    them (`quire router`'s names; unix times)."""

    def __init__(self, pending: int = 0, last_request: float | None = None, last_first_byte: float = 0.0) -> None:
        self.pending = pending
        self.last_request = time.time() if last_request is None else last_request
        self.last_first_byte = last_first_byte

    def metrics(self) -> str:
        lines = []
        for name, value in (("quire_router:pending_requests", self.pending),
                            ("quire_router:last_request_timestamp_seconds", self.last_request),
                            ("quire_router:last_first_byte_timestamp_seconds", self.last_first_byte)):
            lines += [f"# TYPE {name} gauge", f"{name} {float(value)!r}"]
        return "\n".join(lines) + "\n"


class _QuietHandler(BaseHTTPRequestHandler):
    """Logs nothing (the test's output stays readable) and sends whole bodies."""

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: str, content_type: str = "application/json") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _handler(engine: FakeEngine | FixedMetrics | FixedRouterMetrics) -> type[BaseHTTPRequestHandler]:
    class Handler(_QuietHandler):
        def do_GET(self) -> None:
            if self.path in ("/health", "/ready"):
                self._send(200, '{"status": "ok"}')
            elif self.path == "/metrics":
                self._send(200, engine.metrics(), "text/plain; version=0.0.4")
            else:
                self._send(404, '{"error": "not found"}')

        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self._send(404, '{"error": "not found"}')
                return
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            engine.complete(request.get("prompt", ""), int(request.get("max_tokens", 16)))
            self._send(200, json.dumps({"object": "text_completion", "model": MODEL_NAME,
                                        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]}))

    return Handler


class RuntimePod:
    """`tls`: (certificate, key) files: the pod speaks HTTPS, as `quire serve --ssl-*` does."""

    def __init__(self, ip: str, port: int, engine: FakeEngine | FixedMetrics | FixedRouterMetrics | None = None,
                 tls: tuple[str, str] | None = None) -> None:
        self.ip, self.port = ip, port
        self.url = f"{'https' if tls else 'http'}://{ip}:{port}"
        self.engine = engine or FakeEngine()
        self._server = ThreadingHTTPServer((ip, port), _handler(self.engine))
        self._server.daemon_threads = True
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            # The handshake happens in each request's own thread, not in the accept loop.
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                      do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"pod-{ip}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _serve_args(ip: str, port: int) -> list[str]:
    return ["serve", "--host", ip, "--port", str(port), "--served-model-name", MODEL_NAME,
            "--max-num-seqs", str(MAX_NUM_SEQS), "--shutdown-timeout", "5"]


@contextmanager
def start_runtime_pods(ips: list[str], port: int) -> Iterator[list[object]]:
    """One serving pod per ip, as start_runtime_pod makes them; real ones start together."""
    if os.environ.get("QUIRE_E2E_RUNTIME", "real") == "real":
        with quire_processes([(ip, port, _serve_args(ip, port), None) for ip in ips]) as pods:
            yield pods
        return
    with ExitStack() as stack:
        yield [stack.enter_context(start_runtime_pod(ip, port)) for ip in ips]


@contextmanager
def start_runtime_pod(ip: str, port: int) -> Iterator[object]:
    """One serving pod at ip:port until the block ends; /ready answers 200 when this yields."""
    if os.environ.get("QUIRE_E2E_RUNTIME", "real") == "real":
        with _real_server(ip, port) as pod:
            yield pod
        return
    pod = RuntimePod(ip, port)
    try:
        yield pod
    finally:
        pod.stop()


@contextmanager
def _real_server(ip: str, port: int, ready_timeout: float = 300) -> Iterator[subprocess.Popen]:
    with quire_process(ip, port, _serve_args(ip, port), ready_timeout=ready_timeout) as process:
        yield process


@contextmanager
def quire_process(ip: str, port: int, args: list[str], env: dict[str, str] | None = None,
                  ready_timeout: float = 300) -> Iterator[subprocess.Popen]:
    """`quire ARGS` (listening on ip:port) until the block ends; /ready answers 200 when this yields."""
    with quire_processes([(ip, port, args, env)], ready_timeout) as (process,):
        yield process


@contextmanager
def quire_processes(specs: list[tuple[str, int, list[str], dict[str, str] | None]],
                    ready_timeout: float = 300) -> Iterator[list[subprocess.Popen]]:
    """Several `quire` servers, (ip, port, args, env) each, started together so that their
    start-ups (imports, model load) overlap; every one answers /ready when this yields."""
    quire = pathlib.Path(sys.executable).with_name("quire")
    with ExitStack() as stack:
        processes = []
        for _, _, args, env in specs:
            process = subprocess.Popen(die_with_parent([str(quire), *args]),
                                       env={**os.environ, **(env or {})})
            stack.callback(_stop, process)
            processes.append(process)
        deadline = time.monotonic() + ready_timeout
        for (ip, port, _, _), process in zip(specs, processes):
            _wait_ready(process, f"http://{ip}:{port}/ready", deadline,
                        f"quire serve on {ip}:{port}")
        yield processes


def _wait_ready(process: subprocess.Popen, url: str, deadline: float, what: str,
                poll: float = 0.5) -> None:
    """Until `url` answers 200; fails at once if the process exits, or at the deadline."""
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} ({url}) was not ready in time")
        time.sleep(poll)


def _stop(process: subprocess.Popen, timeout: float = 30) -> None:
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def fixed_metrics_pod(ip: str, port: int, waiting: float, kv_usage: float,
                      tls: tuple[str, str] | None = None) -> Iterator[RuntimePod]:
    """A stand-in pod that always exports these two gauges (for scraping, not for serving)."""
    pod = RuntimePod(ip, port, FixedMetrics(waiting, kv_usage), tls)
    try:
        yield pod
    finally:
        pod.stop()


@contextmanager
def fixed_router_pod(ip: str, port: int, pending: int = 0) -> Iterator[RuntimePod]:
    """A stand-in router pod: /metrics says what `pod.engine` (a FixedRouterMetrics) holds."""
    pod = RuntimePod(ip, port, FixedRouterMetrics(pending))
    try:
        yield pod
    finally:
        pod.stop()


@contextmanager
def real_router(ip: str, port: int, *args: str, ready_timeout: float = 120) -> Iterator[subprocess.Popen]:
    """`python -m quire.router` at ip:port with these arguments, until the block ends."""
    process = subprocess.Popen(die_with_parent(
        [sys.executable, "-m", "quire.router", "--host", ip, "--port", str(port), *args]))
    try:
        _wait_ready(process, f"http://{ip}:{port}/health", time.monotonic() + ready_timeout,
                    f"quire router on {ip}:{port}", poll=0.2)
        yield process
    finally:
        _stop(process, timeout=15)


def free_port(*ips: str) -> int:
    """A port that is free on every one of these IPs (pods of one Deployment share a port)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((ips[0], 0))
            port = probe.getsockname()[1]
        try:
            for ip in ips:
                with socket.socket() as s:
                    s.bind((ip, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {ips}")


# --- a replica with the runtime's adapter API (tests/operator/test_adapters.py) ---
#
#     GET  /v1/models               {"data": [{"id": base, "parent": null}, {"id": name, "root": path, "parent": base}]}
#     POST /v1/load_lora_adapter    {"lora_name", "lora_path"} → 200 text; 400 "... has already been loaded"
#                                   or 400 with the reason the adapter is bad
#     POST /v1/unload_lora_adapter  {"lora_name"} → 200; 404 when not loaded
#
# exactly as `quire serve --enable-lora --allow-runtime-lora` (and vLLM) answer it. With an API
# key, every /v1 call needs `Authorization: Bearer <key>` (401 otherwise).


class FakeLoraRuntime:
    def __init__(self, ip: str, port: int, api_key: str | None = None,
                 preloaded: dict[str, str] | None = None) -> None:
        self.ip, self.port, self.api_key = ip, port, api_key
        self.lock = threading.Lock()
        self.adapters: dict[str, str] = dict(preloaded or {})  # name → path
        self.refuse: dict[str, str] = {}  # adapter name → the 400 message a load gets
        self.calls: list[tuple[str, str]] = []  # (path, adapter name) of every load/unload
        self.unauthorized = 0
        self._server = ThreadingHTTPServer((ip, port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"lora-{ip}", daemon=True)
        self._thread.start()

    def loaded(self) -> dict[str, str]:
        with self.lock:
            return dict(self.adapters)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        runtime = self

        class Handler(_QuietHandler):
            def _error(self, status: int, message: str) -> None:
                self._send(status, json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                                         "code": status}}))

            def _authorized(self) -> bool:
                if runtime.api_key and self.headers.get("Authorization") != f"Bearer {runtime.api_key}":
                    runtime.unauthorized += 1
                    self._error(401, "invalid API key")
                    return False
                return True

            def do_GET(self) -> None:
                if self.path in ("/health", "/ready"):
                    self._send(200, '{"status": "ok"}')
                elif self.path == "/v1/models":
                    if not self._authorized():
                        return
                    data = [{"id": MODEL_NAME, "object": "model", "root": MODEL_NAME, "parent": None}]
                    data += [{"id": name, "object": "model", "root": path, "parent": MODEL_NAME}
                             for name, path in runtime.loaded().items()]
                    self._send(200, json.dumps({"object": "list", "data": data}))
                else:
                    self._error(404, "not found")

            def do_POST(self) -> None:
                if self.path not in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                    self._error(404, "not found")
                    return
                if not self._authorized():
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                name = body.get("lora_name")
                with runtime.lock:
                    runtime.calls.append((self.path, name))
                    if self.path == "/v1/load_lora_adapter":
                        if name in runtime.adapters:
                            self._error(400, f"The lora adapter '{name}' has already been loaded.")
                        elif name in runtime.refuse:
                            self._error(400, runtime.refuse[name])
                        else:
                            runtime.adapters[name] = body["lora_path"]
                            self._send(200, f"Success: LoRA adapter '{name}' added successfully.", "text/plain")
                    elif name not in runtime.adapters:
                        self._error(404, f"The lora adapter '{name}' cannot be found.")
                    else:
                        del runtime.adapters[name]
                        self._send(200, f"Success: LoRA adapter '{name}' removed successfully.", "text/plain")

        return Handler


@contextmanager
def fake_lora_runtimes(ips: list[str], port: int, **kwargs) -> Iterator[list[FakeLoraRuntime]]:
    runtimes = [FakeLoraRuntime(ip, port, **kwargs) for ip in ips]
    try:
        yield runtimes
    finally:
        for runtime in runtimes:
            runtime.stop()
