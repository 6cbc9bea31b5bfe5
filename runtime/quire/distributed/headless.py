"""`quire serve --headless --node-rank N`: a node other than node 0 (vLLM's headless mode,
without Ray). It serves no API: it starts this node's ranks, each of which connects to node
0's step channel, gets its WorkerSpec and runs the steps node 0 sends.

It lives as long as its ranks: the first rank to fail (or to lose node 0) ends the others
and the process exits 1, so the pod restarts and LeaderWorkerSet recreates the group; when
node 0 says goodbye, every rank exits 0 and so does this process.
"""

from __future__ import annotations

import logging
import multiprocessing.connection

from quire.config import EngineArgs
from quire.cpu_threads import configure_threads
from quire.distributed.rendezvous import step_port
from quire.distributed.start_method import start_worker, worker_context
from quire.distributed.worker_main import RemoteRank
from quire.distributed.worker_main import main as worker_main
from quire.models.loader import materialize, resolve_model

logger = logging.getLogger(__name__)

GRACE_S = 10.0  # after the first rank exits 0: how long the others get to follow


def check_node_role(args: EngineArgs, headless: bool) -> None:
    """Node 0 serves the API; the others run headless. One line if the flags disagree."""
    if headless and args.nnodes == 1:
        raise ValueError("--headless runs a node other than node 0 of a multi-node group: "
                         "it needs --nnodes > 1 and --node-rank >= 1")
    if headless and args.node_rank == 0:
        raise ValueError("--node-rank 0 is the node that serves the API: run it without "
                         "--headless (the other nodes take --node-rank 1 ... nnodes-1)")
    if not headless and args.node_rank > 0:
        raise ValueError(f"--node-rank {args.node_rank} is not node 0: run it with "
                         f"--headless (only node 0 serves the API)")


def run_headless(args: EngineArgs) -> int:
    check_node_role(args, headless=True)
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    per_node = world // args.nnodes
    ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
    source = materialize(resolve_model(args.model, args.revision, args.download_dir),
                         args.quantization)
    threads = args.num_threads or max(1, configure_threads(None, False) // per_node)
    ctx = worker_context()
    procs = {}
    for rank in ranks:
        spec = RemoteRank(rank, args.master_addr, step_port(args.master_port),
                          args.distributed_timeout, source, threads,
                          logging.getLogger().getEffectiveLevel())
        proc = start_worker(ctx, worker_main, (spec, None), f"quire-rank{rank}")
        procs[proc.sentinel] = (rank, proc)
    logger.info("headless node %d of %d: ranks %d-%d (pids %s), node 0 at %s:%d",
                args.node_rank, args.nnodes, ranks[0], ranks[-1],
                ", ".join(str(p.pid) for _, p in procs.values()), args.master_addr,
                step_port(args.master_port))
    [first] = multiprocessing.connection.wait(list(procs))[:1]
    rank, proc = procs.pop(first)
    proc.join()
    if proc.exitcode != 0:
        logger.error("rank %d exited with code %s; stopping this node's other ranks", rank,
                     proc.exitcode)
        _stop(p for _, p in procs.values())
        return 1
    for _, p in procs.values():  # a goodbye: the others follow
        p.join(GRACE_S)
    codes = [p.exitcode for _, p in procs.values()]
    _stop(p for _, p in procs.values())
    return 0 if all(c == 0 for c in codes) else 1


def _stop(procs) -> None:
    procs = list(procs)
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)
