"""The tensor-parallel worker processes, seen from the engine process (which is rank 0).

Why rank 0 is the engine process: the sampler's batch (a SamplingBatch) refers to the
requests' own state (seeded generators that must advance across steps, the token histories
penalties count), which lives with the scheduler; sampling where that state is avoids
shipping it every step, and costs no extra process. Ranks 1..N-1 are spawned (`torch.multiprocessing` spawn: no forked CUDA or OpenMP
state) and hold their shards.

Each step, `run_step` sends the step's inputs (`StepInputs`: block moves and the prepared
batch as numpy arrays) down one pipe per worker, then runs rank 0's own shard; the ranks meet
in the collectives (all-reduces, the logits gather to rank 0), and only rank 0 samples. A pipe,
not a collective, carries the inputs because a worker waits on it for as long as the engine
is idle (hours), which a collective's timeout would not allow.

A worker's death fails the engine cleanly: a watcher thread waits on the workers' sentinels
and, when one dies, records why and kills the others (so none is left stuck in a
collective); rank 0, if it is inside a collective, gets an error from gloo at once (the dead
peer's sockets close) or at the latest after the collective timeout; the next `run_step`
raises `TensorParallelError` naming the rank, its pid and its exit code.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
import weakref

import torch

from quire import parallel_state as ps
from quire.config import EngineArgs
from quire.distributed.errors import TensorParallelError
from quire.distributed.worker_main import WorkerSpec
from quire.distributed.worker_main import main as worker_main
from quire.models.config import ModelConfig
from quire.models.loader import ModelSource

logger = logging.getLogger(__name__)

DEATH_GRACE_S = 5.0     # after a failed step: how long a dying worker gets to show as dead
SHUTDOWN_GRACE_S = 5.0  # after the goodbye: how long a worker gets to exit before SIGKILL


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(SHUTDOWN_GRACE_S)


def _release(procs, tmp: str) -> None:
    """The last word on a group, run once: by shutdown(), or when the Workers object is
    collected or the interpreter exits without one (an engine whose start-up failed)."""
    _kill(procs)
    ps.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


def _watch(procs, stop, workers_ref) -> None:
    """Waits for the first worker to die (or for the stop signal) and tells the Workers."""
    sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(procs, start=1)}
    ready = multiprocessing.connection.wait([*sentinels, stop])
    workers = workers_ref()
    if stop in ready or workers is None:
        return
    workers._on_death(*sentinels[ready[0]])


class Workers:
    @classmethod
    def start(cls, args: EngineArgs, source: ModelSource, cfg: ModelConfig,
              dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
              max_model_len: int) -> Workers | None:
        """Spawn ranks 1..N-1 and join the group as rank 0; None at size 1. The workers then
        load their shards while the engine loads rank 0's."""
        size = args.tensor_parallel_size
        if size == 1:
            return None
        ps.heads_per_rank(cfg.num_heads, size)      # clear errors before spawning anything
        ps.kv_heads_per_rank(cfg.num_kv_heads, size)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices; "
                             f"{torch.cuda.device_count()} are visible")
        return cls(args, source, cfg, dtype, kv_dtype, device, max_model_len)

    def __init__(self, args, source, cfg, dtype, kv_dtype, device, max_model_len) -> None:
        self.size = size = args.tensor_parallel_size
        threads = args.num_threads
        if threads is None and device.type == "cpu":  # the ranks share the cores
            threads = max(1, torch.get_num_threads() // size)  # the quota's (cpu_threads)
            torch.set_num_threads(threads)
        self._tmp = tempfile.mkdtemp(prefix="quire-tp-")
        init_method = "file://" + os.path.join(self._tmp, "rendezvous")
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, size):
            spec = WorkerSpec(rank, size, init_method, args, source, cfg, dtype, kv_dtype,
                              device.type, max_model_len, threads,
                              logging.getLogger().getEffectiveLevel())
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, theirs), daemon=True,
                               name=f"quire-tp-rank{rank}")
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        self._finalizer = weakref.finalize(self, _release, list(self.procs), self._tmp)
        self.dead: str | None = None
        self.closed = False
        self.worker_param_bytes: dict[int, int] = {}
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        # holds no reference to self while it waits, so an engine dropped without
        # shutdown() is still collected (and its finalizer kills the workers)
        self._watcher = threading.Thread(
            target=_watch, args=(list(self.procs), self._stop_r, weakref.ref(self)),
            name="quire-tp-watch", daemon=True)
        self._watcher.start()
        try:
            list(self._expect("joining", "starting"))
            ps.init_process_group(0, size, init_method, device)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (workers: pids %s)", size,
                    ", ".join(str(p.pid) for p in self.procs))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # --- start-up ------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        """Once the workers have loaded: the same number of blocks (each for its KV heads)."""
        for rank, msg in self._expect("loaded", "loading its shard"):
            self.worker_param_bytes[rank] = msg[1]
        for conn in self.conns:
            conn.send((num_blocks, num_host_blocks))
        list(self._expect("ready", "allocating its KV cache"))

    def _expect(self, kind: str, doing: str):
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            ready = multiprocessing.connection.wait([conn, proc.sentinel])
            msg = None
            if conn in ready:
                try:
                    msg = conn.recv()
                except EOFError:
                    pass
            if msg is None or msg[0] != kind:
                proc.join(DEATH_GRACE_S)
                self.shutdown()
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                    f"{proc.exitcode} while {doing}; its log says why")
            yield rank, msg

    # --- steps ---------------------------------------------------------------------------
    def run_step(self, inputs, run_local):
        """Send the step to every worker, run rank 0's part; any failure is fatal."""
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        if self.closed:
            raise TensorParallelError("the tensor-parallel workers were shut down")
        try:
            for conn in self.conns:
                conn.send(inputs)
            return run_local(inputs)
        except Exception as e:  # noqa: BLE001 - a rank out of step: nothing can go on
            raise self._failed(e) from e

    def _failed(self, error: Exception) -> TensorParallelError:
        deadline = time.monotonic() + DEATH_GRACE_S
        while self.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)  # a killed peer fails gloo a moment before its sentinel fires
        reason = self.dead or f"a tensor-parallel step failed: {type(error).__name__}: {error}"
        logger.error("%s; stopping the other workers", reason)
        self.shutdown()
        self.dead = reason
        return TensorParallelError(reason)

    def _on_death(self, rank: int, proc) -> None:
        if self.closed:
            return  # an orderly shutdown
        proc.join(1.0)
        self.dead = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) died (exit code "
                     f"{proc.exitcode}); the engine cannot go on without it")
        logger.error("%s; stopping the other workers", self.dead)
        _kill(self.procs)

    # --- shutdown ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Say goodbye, give the workers a moment to exit, then SIGKILL whatever is left."""
        if self.closed:
            return
        self.closed = True
        self._stop_w.send(None)
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass  # already gone
        for p in self.procs:
            p.join(SHUTDOWN_GRACE_S)
        for conn in self.conns:
            conn.close()
        self._finalizer()  # kills the stragglers, leaves the group
