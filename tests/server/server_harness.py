"""Real `quire serve` processes for the server tests.

Each server is uvicorn in a subprocess on a free port. All of them are started together the
first time any test asks for one (loading models in parallel saves minutes on two cores), and
they are stopped when the test process exits. From each process's start a thread polls /ready
every 0.1 s until it answers 200, keeping the answers in `ServerProcess.ready_history`.

Not a conftest.py: the runtime tests import theirs as the module `conftest`, and a second one
would replace it in sys.modules. The tiny-model helpers come from tests/runtime/runtime_helpers.py.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from child_processes import die_with_parent, share

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
API_KEY = "test-key-7f3a"
SMOLLM_NAME = "smollm2"
READY_TIMEOUT = 300.0

_runtime_helpers = None


def runtime_helpers():
    """tests/runtime/runtime_helpers.py (tiny_config, save_tiny_model, ...), loaded by path."""
    global _runtime_helpers
    if _runtime_helpers is None:
        spec = importlib.util.spec_from_file_location(
            "runtime_helpers", ROOT / "tests" / "runtime" / "runtime_helpers.py")
        _runtime_helpers = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_runtime_helpers)
    return _runtime_helpers


_tmp_root: str | None = None


def tmp_root() -> str:
    global _tmp_root
    if _tmp_root is None:
        _tmp_root = tempfile.mkdtemp(prefix="quire-server-tests-")
        atexit.register(shutil.rmtree, _tmp_root, True)
    return _tmp_root


_tiny_model: str | None = None


def tiny_model() -> str:
    """A tiny random Llama (3 layers, hidden 64) with the SmolLM2 tokenizer, saved once."""
    global _tiny_model
    if _tiny_model is None:
        from quire.models.loader import load_tokenizer, materialize, resolve_model
        helpers = runtime_helpers()
        tokenizer = load_tokenizer(materialize(resolve_model(None)), None)
        path = os.path.join(tmp_root(), "tiny-llama")
        helpers.save_tiny_model(path, helpers.tiny_config("llama"), tokenizer)
        _tiny_model = path
    return _tiny_model


_reference_llm = None


def reference_llm():
    """The default model in this process (float32, one thread): the greedy reference."""
    global _reference_llm
    if _reference_llm is None:
        from quire import LLM
        _reference_llm = LLM(dtype="float32", kv_cache_memory=64 << 20, num_threads=1)
    return _reference_llm


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None,
                 launcher: list[str] | None = None, api_key: str | None = None) -> None:
        self.name = name
        self.args = args
        self.env = env or {}
        self.launcher = launcher or [sys.executable, "-m", "quire.entrypoints.cli"]
        self.api_key = api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp_root(), f"{name}.log")
        self.proc: subprocess.Popen | None = None
        self.ready_history: list[int | None] = []  # /ready answers while loading
        self.is_ready = False

    def start(self) -> None:
        env = {**os.environ, **self.env}
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [*self.launcher, "serve", *self.args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(die_with_parent(cmd), stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self._poller = threading.Thread(target=self._poll_until_ready, daemon=True)
        self._poller.start()

    def restart(self) -> None:
        """Start it again after it exited, on the same port, with a fresh log."""
        self._log.close()
        self.ready_history, self.is_ready = [], False
        self.start()

    def _poll_until_ready(self) -> None:
        """From the start: probe /ready every 0.1 s until it says 200 or the process ends."""
        while self.proc.poll() is None and not self.poll_ready():
            time.sleep(0.1)

    def wait_ready(self, timeout: float) -> None:
        if self.is_ready:
            return
        self._poller.join(timeout)
        if not self.is_ready:
            state = ("exited with %s" % self.proc.returncode if self.proc.poll() is not None
                     else f"not ready after {timeout:.0f}s")
            raise RuntimeError(f"server {self.name} {state}:\n{self.log_tail()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def poll_ready(self) -> bool:
        """One /ready probe; True once ready."""
        if self.is_ready:
            return True
        try:
            status = requests.get(self.url + "/ready", timeout=2).status_code
        except requests.RequestException:
            status = None  # not listening yet
        self.ready_history.append(status)
        self.is_ready = status == 200
        return self.is_ready

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def log_lines(self) -> list[str]:
        with open(self.log_path) as f:
            return f.read().splitlines()

    def error_lines(self, since: int = 0) -> list[str]:
        """Lines from line `since` on that log at ERROR or show a traceback."""
        return [line for line in self.log_lines()[since:]
                if " ERROR " in line or "Traceback" in line or "never retrieved" in line]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# Two cores are shared by the servers, the test process's reference LLMs and whatever else
# runs: one torch thread each (oversubscribed OpenMP threads make every step several times
# slower).
def _smollm_config() -> ServerProcess:
    # The default model (real text), vLLM metric names too, a served name of its own, and
    # vLLM's /tokenizer_info.
    return ServerProcess("smollm", [
        "--served-model-name", SMOLLM_NAME, "--dtype", "float32", "--max-model-len", "2048",
        "--kv-cache-memory", "128M", "--metrics-compat", "vllm", "--max-num-seqs", "16",
        "--num-threads", "1", "--enable-tokenizer-info-endpoint"])


# Every tiny-model server runs under fault_launcher.py: prompts starting with "__slow__" make
# requests that cannot finish on their own in any test's time, on any machine.
FAULT_LAUNCHER = [sys.executable, str(HERE / "fault_launcher.py")]
HOSTILE_LIMITS = ["--allow-request-chat-template", "--chat-template-timeout", "2",
                  "--request-body-timeout", "2",
                  "--timeout-header", "2", "--timeout-keep-alive", "2",
                  "--max-request-body-bytes", "1M", "--max-header-bytes", "8192"]


def _tiny_configs() -> dict[str, ServerProcess]:
    tiny = tiny_model()
    fp32_small = ["--dtype", "float32", "--kv-cache-memory", "16M", "--num-threads", "1"]
    return {
        # Tiny model, no prefix caching (blocks must all come back), 8 sequences at once so
        # 64 clients queue; the API key comes from the environment; request chat templates
        # allowed and short connection timeouts, for the hostile-client tests.
        "tiny": ServerProcess("tiny", [tiny, *fp32_small, "--no-enable-prefix-caching",
                                       "--max-num-seqs", "8", "--log-requests",
                                       *HOSTILE_LIMITS],
                              env={"QUIRE_API_KEY": API_KEY}, api_key=API_KEY,
                              launcher=FAULT_LAUNCHER),
        # One sequence at a time and a queue of one: for --max-queue-len and the SIGTERM drain.
        "queue": ServerProcess("queue", [tiny, *fp32_small, "--max-num-seqs", "1",
                                         "--max-queue-len", "1", "--shutdown-timeout", "3"],
                               launcher=FAULT_LAUNCHER),
        # An engine whose step raises once a request with the prompt "__die__" is added.
        "fault": ServerProcess("fault", [tiny, *fp32_small], launcher=FAULT_LAUNCHER),
    }


_servers: dict[str, ServerProcess] | None = None


def server(name: str) -> ServerProcess:
    """The named server, started (all of them at once, the first time) and ready."""
    global _servers
    if _servers is None:
        _servers = {"smollm": _smollm_config()}
        _servers["smollm"].start()  # it loads while the tiny model is written
        share(_servers["smollm"])
        tiny = _tiny_configs()
        for s in tiny.values():
            s.start()
            share(s)  # stopped at the session's end (tests/conftest.py), killed with it
        _servers.update(tiny)
    wanted = _servers[name]
    if wanted.proc.poll() is not None:  # a test ended it on purpose (the fault server's death)
        wanted.restart()
    deadline = time.monotonic() + READY_TIMEOUT
    for s in _servers.values():  # (a failure here fails every test that asks, not only one)
        if s.proc.poll() is None or s is wanted:
            s.wait_ready(max(1.0, deadline - time.monotonic()))
    return wanted


def wait_idle(srv: ServerProcess, timeout: float = 30.0, until=None) -> dict:
    """/metrics once nothing runs, waits or holds a KV block and `until(samples)` holds, if
    given (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = metrics_of(srv)
        idle = (metric(samples, "quire:num_requests_running") == 0
                and metric(samples, "quire:num_requests_waiting") == 0
                and metric(samples, "quire:kv_cache_blocks_used") == 0
                and (until is None or until(samples)))
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def metrics_of(srv: ServerProcess) -> dict[tuple[str, frozenset], float]:
    """The server's /metrics, parsed by prometheus_client: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(srv.url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    """One sample's value; labels not given are summed over."""
    total, found = 0.0, False
    for (n, lbls), v in samples.items():
        if n == name and all((k, val) in lbls for k, val in labels.items()):
            total += v
            found = True
    if not found:
        raise KeyError(f"no sample {name} {labels}")
    return total


def openai_client(srv):
    """The official client on a test server: no retries (a failure must show), long timeout."""
    import openai
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)
