"""`quire serve` as the operator's pods run it: the root filesystem read-only, HOME (with
XDG_CACHE_HOME under it) and TMPDIR on writable volumes (issue 36).

What this proves, and what it does not: the server runs under read_only_launcher.py, whose
audit hook fails (EROFS) and records every write that Python code in the server process makes
outside the writable folders, as a read-only root would. So the Python side (the runtime,
transformers, huggingface_hub, torch's Python parts, tempfile) is shown to write nowhere else,
and to find the mounts from HOME, XDG_CACHE_HOME and TMPDIR alone. Native code's own writes and
the C++ compiler's (a child process; it gets TMPDIR and an output path inside the cache) are not
seen; a real read-only root on a cluster is the final word on those.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import threading

import requests

from child_processes import die_with_parent
from server_harness import HERE, ROOT, ServerProcess, tmp_root

LAUNCHER = [sys.executable, str(HERE / "read_only_launcher.py")]
READY_TIMEOUT = 600.0  # the default GGUF is converted once, on a busy two-core machine


def _pod_like(folder: str, writable: list[str], **env: str) -> dict[str, str]:
    """The pod's variables (quire_operator/pod_security.py), with this test's folders."""
    log = os.path.join(folder, "blocked-writes.log")
    base = {"PYTHONDONTWRITEBYTECODE": "1", "QUIRE_TEST_WRITABLE": os.pathsep.join(writable),
            "QUIRE_TEST_WRITE_LOG": log}
    # A developer's own cache settings must not leak in: the test names every folder itself.
    for var in ("QUIRE_CACHE_DIR", "XDG_CACHE_HOME", "HF_HOME", "TMPDIR", "TEMP", "TMP",
                "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        base[var] = ""
    return {**base, **env}


def _clean_env(env: dict[str, str]) -> dict[str, str]:
    """os.environ with `env` laid over it; "" removes a variable."""
    merged = {**os.environ, **env}
    return {k: v for k, v in merged.items() if v != ""}


def _blocked(folder: str) -> list[str]:
    path = os.path.join(folder, "blocked-writes.log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return f.read().splitlines()


def test_quire_serve_writes_only_to_home_and_tmp():
    folder = os.path.join(tmp_root(), "read-only-root")
    # Three folders, not the pod's two (there XDG_CACHE_HOME is $HOME/.cache): the caches must
    # follow XDG_CACHE_HOME, not HOME.
    home, cache, tmp = (os.path.join(folder, name) for name in ("home", "cache", "tmp"))
    for path in (home, cache, tmp):
        os.makedirs(path)
    env = _pod_like(folder, [home, cache, tmp], HOME=home, XDG_CACHE_HOME=cache, TMPDIR=tmp)
    _seed_the_two_large_kernels(os.path.join(cache, "quire", "kernels"))
    # The default model (a GGUF: the conversion cache and the native kernels both write).
    srv = PodLikeServer("read-only-root", ["--dtype", "float32", "--kv-cache-memory", "64M",
                                           "--num-threads", "1"], _clean_env(env))
    srv.start()
    try:
        srv.wait_ready(READY_TIMEOUT)
        out = requests.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).json()
        assert out["choices"][0]["text"], out
        assert _blocked(folder) == [], "writes outside HOME and TMPDIR"
        # The caches went where XDG_CACHE_HOME says, not to a per-process fallback.
        assert glob.glob(os.path.join(cache, "quire", "gguf", "*", "model.safetensors"))
        for kernel in ("fused_ops", "decode_stack"):  # built there by the server itself
            assert glob.glob(os.path.join(cache, "quire", "kernels", f"{kernel}-*.so")), kernel
        assert not os.path.exists(os.path.join(home, ".cache", "quire"))
        log = "\n".join(srv.log_lines())
        assert "cannot be written" not in log and "could not be built" not in log, srv.log_tail()
        srv.signal(signal.SIGTERM)
        assert srv.wait_exit(60) == 0, srv.log_tail()
        assert _blocked(folder) == [], "writes outside HOME and TMPDIR while stopping"
    finally:
        srv.stop()


def _seed_the_two_large_kernels(kernels: str) -> None:
    """The suite's own builds of paged_decode.cpp and quant_matmul.cpp (~40 s of compiling
    on two cores) go into the pod's empty cache; the server still compiles the other two
    kernels into it, which is what shows where its builds go."""
    from quire.native import loader
    os.makedirs(kernels)
    for source in ("paged_decode.cpp", "quant_matmul.cpp"):
        loader.load_library(source)  # built in the suite's cache, if it was not yet
        for built in glob.glob(os.path.join(loader._cache_dir(), source[:-4] + "-*.so")):
            shutil.copy(built, kernels)


class PodLikeServer(ServerProcess):
    """A ServerProcess whose environment is exactly `env` (the harness's adds to os.environ,
    and this test must also take variables away)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        super().__init__(name, args, launcher=LAUNCHER)
        self.exact_env = env

    def start(self) -> None:
        cmd = [*self.launcher, "serve", *self.args, "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(die_with_parent(cmd), stdout=self._log,
                                     stderr=subprocess.STDOUT, env=self.exact_env, cwd=ROOT)
        self._poller = threading.Thread(target=self._poll_until_ready, daemon=True)
        self._poller.start()


def _import_quire(folder: str, writable: list[str], **env: str) -> subprocess.CompletedProcess:
    """`quire --help` under the read-only launcher: the import alone (it imports torch)."""
    return subprocess.run([*LAUNCHER, "--help"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=_clean_env(_pod_like(folder, writable, **env)))


def test_with_nothing_writable_one_error_names_the_folders_and_variables():
    """Was: torch's import failed deep inside (`No usable temporary directory found`)."""
    folder = os.path.join(tmp_root(), "nothing-writable")
    os.makedirs(os.path.join(folder, "home"))
    home = os.path.join(folder, "home")
    done = _import_quire(folder, [], HOME=home)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("quire.writable_dirs.NoWritableDirectory:"), done.stderr[-3000:]
    assert "TMPDIR is unset" in last and "/tmp" in last and "emptyDir" in last
    assert os.path.join(home, ".cache", "quire", "tmp") in last and "$HOME/.cache/quire" in last
    assert "No usable temporary directory" not in done.stderr


def test_without_a_writable_tmp_the_cache_holds_the_temporary_files():
    folder = os.path.join(tmp_root(), "cache-only")
    cache = os.path.join(folder, "cache")
    os.makedirs(cache)
    done = _import_quire(folder, [cache], HOME=os.path.join(folder, "home"), XDG_CACHE_HOME=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"using {cache}/quire/tmp" in done.stderr
    assert os.path.isdir(os.path.join(cache, "quire", "tmp"))
