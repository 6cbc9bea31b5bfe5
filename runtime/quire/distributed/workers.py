"""The worker processes (tensor and pipeline ranks), seen from the engine process (rank 0).

Why rank 0 is the engine process: the sampler's batch (a SamplingBatch) refers to the
requests' own state (seeded generators that must advance across steps, the token histories
penalties count), which lives with the scheduler; sampling where that state is avoids
shipping it every step, and costs no extra process. The other ranks of node 0 are started
from a fork server (start_method.py: no forked CUDA or OpenMP state, and a second engine's
ranks start in a fraction of a second); those of the other nodes are started there by
`quire serve --headless` (headless.py) and connect to this process (rendezvous.py). Each
holds its shard: its tensor slice of its pipeline stage's layers.

Each step, `run_step` sends the step's inputs (`StepInputs`: block moves and the prepared
batch, or micro-batches, as numpy arrays) down one channel per worker (a pipe on this node,
a socket to another), then runs rank 0's own part; the ranks meet in the collectives
(all-reduces, the logits gather) and the stage-to-stage sends, and only rank 0 samples. A
channel, not a collective, carries the inputs because a worker waits on it for as long as
the engine is idle (hours), which a collective's timeout would not allow.

A worker's death fails the engine cleanly: a watcher thread waits on the local workers'
sentinels and the remote workers' channels (a dead process's socket closes) and, when one
dies, records why, kills the others (so none is left stuck in a collective) and calls
`on_death` (the server then fails at once, idle or not, even with a step stuck in a
collective with the dead rank: the process exits without waiting for it); rank 0, if it is
inside a collective, gets an error from gloo at once (the dead peer's sockets close) or at the
latest after the collective timeout; the next `run_step` raises `TensorParallelError` naming
the rank, where it ran and why. A remote rank behind a cut link is found by the step
channel's TCP keepalive (rendezvous.KEEPALIVE).
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
from quire.distributed.start_method import start_worker, worker_context
from quire.distributed.worker_main import WorkerSpec
from quire.distributed.worker_main import main as worker_main
from quire.distributed.world import World
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


def _release(procs, tmp: str, remote_conns) -> None:
    """The last word on a group, run once: by shutdown(), or when the Workers object is
    collected or the interpreter exits without one (an engine whose start-up failed)."""
    _kill(procs)
    for conn in remote_conns:  # the remote workers see their channel close and exit
        conn.close()
    ps.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


def _watch(waitables: dict, stop, workers_ref) -> None:
    """Waits for the first worker to die (a local one's sentinel, a remote one's channel
    becoming readable: after start-up they send nothing, so that is its end) or for the
    stop signal, and tells the Workers."""
    ready = multiprocessing.connection.wait([*waitables, stop])
    workers = workers_ref()
    if stop in ready or workers is None:
        return
    workers._on_death(waitables[ready[0]])


class Workers:
    @classmethod
    def start(cls, args: EngineArgs, source: ModelSource, cfg: ModelConfig,
              dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
              max_model_len: int, world: World) -> Workers | None:
        """Spawn this node's other ranks, wait for the other nodes' (if any), and join the
        group as rank 0; None at size 1. The workers then load their shards while the engine
        loads rank 0's."""
        if world.size == 1:
            return None
        ps.heads_per_rank(cfg.num_heads, world.tp)  # clear errors before spawning anything
        ps.kv_heads_per_rank(cfg.num_kv_heads, world.tp)
        local = world.ranks_per_node
        if device.type == "cuda" and torch.cuda.device_count() < local:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size / nnodes = {local} "
                             f"ranks on this node need {local} CUDA devices; "
                             f"{torch.cuda.device_count()} are visible")
        return cls(args, source, cfg, dtype, kv_dtype, device, max_model_len, world)

    def __init__(self, args, source, cfg, dtype, kv_dtype, device, max_model_len,
                 world: World) -> None:
        self.world = world
        self.size = size = world.size
        threads = args.num_threads
        if threads is None and device.type == "cpu":  # this node's ranks share its cores
            threads = max(1, torch.get_num_threads() // world.ranks_per_node)  # (cpu_threads)
            torch.set_num_threads(threads)
        self._tmp = tempfile.mkdtemp(prefix="quire-tp-")
        if world.nnodes == 1:
            init_method = "file://" + os.path.join(self._tmp, "rendezvous")
        else:
            init_method = f"tcp://{args.master_addr}:{args.master_port}"

        def spec_for(rank: int) -> WorkerSpec:
            return WorkerSpec(rank, size, world.tp, world.local_rank(rank), world.stage(rank),
                              init_method, args, source, cfg, dtype, kv_dtype, device.type,
                              max_model_len, threads if world.node_of(rank) == 0 else
                              args.num_threads, logging.getLogger().getEffectiveLevel())

        ctx = worker_context()
        self.procs: dict[int, object] = {}   # this node's workers
        self.conns: dict[int, object] = {}   # every worker's channel, by rank
        self.where: dict[int, str] = {}      # rank -> "pid 123" / "node 1 (10.0.0.2)"
        for rank in world.node_ranks(0)[1:]:
            ours, theirs = ctx.Pipe()
            proc = start_worker(ctx, worker_main, (spec_for(rank), theirs), f"quire-rank{rank}")
            theirs.close()
            self.procs[rank], self.conns[rank] = proc, ours
            self.where[rank] = f"pid {proc.pid}"
        self.remote: dict[int, object] = {}
        self._finalizer = weakref.finalize(self, _release, list(self.procs.values()),
                                           self._tmp, [])
        self.dead: str | None = None
        self.closed = False
        # the death watcher and the engine thread both close channels, maybe at once: a
        # Connection's close is not thread-safe (two closes of one fd: EBADF in the loser)
        self._channels_lock = threading.Lock()
        self.on_death = None  # callable(), from the watcher thread: the server fails fast
        self.worker_param_bytes: dict[int, int] = {}
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self._watchers = []
        # holds no reference to self while it waits, so an engine dropped without
        # shutdown() is still collected (and its finalizer kills the workers)
        self._watch_for_deaths({p.sentinel: rank for rank, p in self.procs.items()})
        try:
            if world.nnodes > 1:
                self._accept_remote(args, spec_for)
            list(self._expect("joining", "starting", args.distributed_timeout))
            if world.nnodes > 1:
                from quire.distributed.rendezvous import pin_gloo_interface
                pin_gloo_interface(args.master_addr)
            ps.init_process_group(0, size, init_method, device, tp_size=world.tp)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%s (workers: %s)", world.describe(),
                    ", ".join(f"rank {r} {w}" for r, w in self.where.items()))

    def _accept_remote(self, args, spec_for) -> None:
        from quire.distributed.rendezvous import RemoteWorkers, step_port
        world = self.world
        ranks = [r for r in range(world.size) if world.node_of(r) != 0]
        rendezvous = RemoteWorkers(step_port(args.master_port), ranks,
                                   lambda r: f"rank {r} (node {world.node_of(r)})")
        try:
            self.remote = rendezvous.accept_all(args.distributed_timeout, spec_for)
        except TimeoutError as e:
            raise TensorParallelError(str(e)) from None
        finally:
            rendezvous.close()
        for rank, conn in sorted(self.remote.items()):
            self.conns[rank] = conn
            self.where[rank] = f"on node {world.node_of(rank)}"
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, list(self.procs.values()),
                                           self._tmp, list(self.remote.values()))

    def _watch_for_deaths(self, waitables: dict) -> None:
        watcher = threading.Thread(
            target=_watch, args=(waitables, self._stop_r, weakref.ref(self)),
            name="quire-workers-watch", daemon=True)
        watcher.start()
        self._watchers.append(watcher)

    @property
    def pids(self) -> list[int]:
        """This node's workers."""
        return [p.pid for p in self.procs.values()]

    # --- start-up ------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        """Once the workers have loaded: the same number of blocks (each for its KV heads
        of its stage's layers)."""
        for rank, msg in self._expect("loaded", "loading its shard", None):
            self.worker_param_bytes[rank] = msg[1]
        for conn in self.conns.values():
            conn.send((num_blocks, num_host_blocks))
        list(self._expect("ready", "allocating its KV cache", None))
        if self.remote:  # from now on a remote channel that becomes readable has closed
            self._watch_for_deaths({conn: rank for rank, conn in self.remote.items()})

    def _expect(self, kind: str, doing: str, timeout: float | None):
        for rank, conn in self.conns.items():
            proc = self.procs.get(rank)
            ready = multiprocessing.connection.wait(
                [conn] + ([proc.sentinel] if proc is not None else []), timeout)
            msg = None
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    pass
            if msg is None or msg[0] != kind:
                if proc is not None:
                    proc.join(DEATH_GRACE_S)
                self.shutdown()
                raise TensorParallelError(self._describe_end(rank, f"while {doing}") + (
                    "; its log says why" if proc is not None else
                    "; the log of its node's `quire serve --headless` says why"))
            yield rank, msg

    def _describe_end(self, rank: int, when: str) -> str:
        proc = self.procs.get(rank)
        if proc is not None:
            return (f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode} "
                    f"{when}")
        return (f"worker rank {rank} on node {self.world.node_of(rank)} went away (its "
                f"channel closed) {when}")

    # --- steps ---------------------------------------------------------------------------
    def check(self) -> None:
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        if self.closed:
            raise TensorParallelError("the workers were shut down")

    def run_step(self, inputs, run_local):
        """Send the step to every worker, run rank 0's part; any failure is fatal."""
        self.check()
        try:
            for conn in self.conns.values():
                conn.send(inputs)
            return run_local(inputs)
        except Exception as e:  # noqa: BLE001 - a rank out of step: nothing can go on
            raise self._failed(e) from e

    def _failed(self, error: Exception) -> TensorParallelError:
        deadline = time.monotonic() + DEATH_GRACE_S
        while self.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)  # a killed peer fails gloo a moment before its sentinel fires
        reason = self.dead or f"a parallel step failed: {type(error).__name__}: {error}"
        logger.error("%s; stopping the other workers", reason)
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - the reason above is the error, whatever this is
            logger.exception("stopping the workers after %s", reason)
        self.dead = reason
        return TensorParallelError(reason)

    def _on_death(self, rank: int) -> None:
        if self.closed:
            return  # an orderly shutdown
        proc = self.procs.get(rank)
        if proc is not None:
            proc.join(1.0)
            self.dead = (f"worker rank {rank} (pid {proc.pid}) died (exit code "
                         f"{proc.exitcode}); the engine cannot go on without it")
        else:
            self.dead = (f"worker rank {rank} on node {self.world.node_of(rank)} died (its "
                         f"channel closed); the engine cannot go on without it")
        logger.error("%s; stopping the other workers", self.dead)
        _kill(self.procs.values())
        self._close_channels(self.remote.values())
        if self.on_death is not None:
            self.on_death()

    # --- shutdown ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Say goodbye, give the workers a moment to exit, then SIGKILL whatever is left."""
        if self.closed:
            return
        self.closed = True
        self._stop_w.send(None)
        for conn in self.conns.values():
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass  # already gone (or closed by the death watcher)
        for p in self.procs.values():
            p.join(SHUTDOWN_GRACE_S)
        self._close_channels(self.conns.values())
        self._finalizer()  # kills the stragglers, leaves the group

    def _close_channels(self, conns) -> None:
        """Closes each channel once, whichever thread gets here first (a closed one's close
        is a no-op); an error closing one (the peer's end already gone) does not stop the
        others."""
        with self._channels_lock:
            for conn in list(conns):
                try:
                    conn.close()
                except OSError:
                    pass
