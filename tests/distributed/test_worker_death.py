"""A worker's death fails a tensor-parallel engine cleanly: a clear error within a bounded
time, no hang, and no process left behind, whether the worker dies mid-run or the engine
process itself is killed."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from quire.config import EngineArgs
from quire.distributed.errors import TensorParallelError
from quire.engine.engine import LLMEngine
from quire.sampling_params import SamplingParams

from tp_helpers import ROOT, TP, alive, wait_gone, worker_processes

DEATH_NOTICED_S = 60.0  # generous: gloo fails at once when a peer's sockets close


def _engine(path: str) -> LLMEngine:
    return LLMEngine(EngineArgs(model=path, dtype="float32", kv_cache_memory=4 << 20,
                                tensor_parallel_size=TP, num_threads=1))


def test_killing_a_worker_mid_run_fails_the_engine_within_a_bounded_time(tp_models):
    engine = _engine(tp_models["llama"])
    try:
        [worker] = engine.executor.workers.pids
        assert worker_processes(os.getpid()) == [worker]
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        for i in range(4):
            engine.add_request(str(i), list(range(3, 60 + i)), params)
        for _ in range(3):
            engine.step()  # running normally
        killed_at = []
        killer = threading.Timer(0.2, lambda: (killed_at.append(time.monotonic()),
                                               os.kill(worker, signal.SIGKILL)))
        killer.start()
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {worker}\) died"):
            deadline = time.monotonic() + 300  # far more steps than the kill needs
            while time.monotonic() < deadline and engine.has_unfinished_requests():
                engine.step()
        killer.join()
        noticed = time.monotonic() - killed_at[0]
        print(f"worker death noticed {noticed:.2f} s after the kill")
        assert noticed < DEATH_NOTICED_S
        with pytest.raises(TensorParallelError):  # and it stays dead
            engine.step()
        assert not alive(worker)
    finally:
        engine.shutdown()


def test_a_channel_closed_by_both_threads_still_leaves_the_error_naming_the_rank(tp_models):
    """The death watcher and a failing step both close the workers' channels, maybe at once,
    and the loser's close of the fd fails (EBADF). That must not replace the error naming
    the dead rank: once, under load, the two-node test's stream ended with "model step
    failed: [Errno 9] Bad file descriptor" instead. The race is made certain here: the
    channel's close closes it, then fails as the loser's would."""
    engine = _engine(tp_models["llama"])
    try:
        workers = engine.executor.workers
        [worker] = workers.pids
        [conn] = workers.conns.values()
        close = conn.close

        def close_raced():
            close()
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))

        conn.close = close_raced
        engine.add_request("0", list(range(3, 40)),
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + DEATH_NOTICED_S
        while workers.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        # what run_step does when a send or a collective fails mid-step
        error = workers._failed(ConnectionResetError("the peer closed the connection"))
        assert isinstance(error, TensorParallelError)
        assert f"rank 1 (pid {worker}) died" in str(error)
        assert conn.closed and workers.closed
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {worker}\) died"):
            engine.step()
    finally:
        engine.shutdown()


def test_workers_exit_when_the_engine_process_is_killed(tp_models, tmp_path):
    """SIGKILL of the engine process runs no cleanup of its own: the workers notice and go."""
    script = tmp_path / "engine_then_die.py"
    script.write_text(
        "import os, signal, sys\n"
        "from quire.config import EngineArgs\n"
        "from quire.engine.engine import LLMEngine\n"
        "if __name__ == '__main__':\n"
        f"    e = LLMEngine(EngineArgs(model={tp_models['llama']!r}, dtype='float32',\n"
        f"                            kv_cache_memory=1 << 20, tensor_parallel_size={TP},\n"
        "                            num_threads=1))\n"
        "    print(*e.executor.workers.pids, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == TP - 1
    assert not wait_gone(pids, timeout=30), "workers outlived the engine process"
