"""A worker process (ranks 1..N-1): join the group, build and load this rank's shard (its
tensor slice of its pipeline stage's layers), allocate its KV cache, then run every step the
engine process sends.

It never outlives its parent (the engine process on node 0, the headless process on the
others): a thread waits on the parent's sentinel and exits the moment the parent is gone
(however it went: SIGKILL included), and a closed channel or a failed collective ends it
too. Any error exits non-zero, which the engine sees as a dead worker. A remote worker whose
node 0 vanished without a goodbye exits non-zero too (its group must restart).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from dataclasses import dataclass

import torch

from quire.config import EngineArgs
from quire.models.config import ModelConfig
from quire.models.loader import ModelSource, load_hf_config

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    rank: int
    size: int
    tp_size: int
    local_rank: int                # its GPU on its node
    stage: object                  # its parallel_state.PipelineStage
    init_method: str
    args: EngineArgs
    source: ModelSource
    cfg: ModelConfig
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device_type: str
    max_model_len: int
    num_threads: int | None
    log_level: int


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)  # the engine is gone; nothing here is worth a clean exit

    threading.Thread(target=watch, name="quire-parent-watch", daemon=True).start()


@dataclass
class RemoteRank:
    """What a headless node's worker knows before node 0 sends its WorkerSpec."""
    rank: int
    master_addr: str
    step_port: int
    timeout: float
    source: ModelSource  # this node's copy of the model
    num_threads: int     # this node's cores, shared by its ranks
    log_level: int


def check_same_model(source: ModelSource, sent: WorkerSpec) -> None:
    """This node's copy of the model against node 0's: a node with another model would load
    what of it matches node 0's layout (a Qwen3's q/k norms dropped without a word) and the
    group would serve text neither model writes. The configs are compared, field by field
    (the weights themselves are not: a copy of other weights in the same shape passes)."""
    mine = ModelConfig.from_hf(load_hf_config(source, sent.args.revision))
    differ = [f.name for f in dataclasses.fields(mine)
              if f.repr and getattr(mine, f.name) != getattr(sent.cfg, f.name)]
    if differ:
        shown = ", ".join(f"{n} {getattr(mine, n)!r} here, {getattr(sent.cfg, n)!r} on node 0"
                          for n in differ[:4])
        raise RuntimeError(f"rank {sent.rank}: this node's model ({source.path}) is not node "
                           f"0's: {shown}; every node must serve the same checkpoint")


def main(spec: WorkerSpec | RemoteRank, conn) -> None:
    _exit_with_parent()
    remote = isinstance(spec, RemoteRank)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: "
                               "%(message)s")
    try:
        if remote:
            from quire.distributed.rendezvous import connect
            conn, sent = connect(spec.master_addr, spec.step_port, spec.rank, spec.timeout)
            check_same_model(spec.source, sent)
            sent.source = spec.source
            sent.num_threads = sent.num_threads or spec.num_threads
            spec = sent
        _serve(spec, conn)
    except EOFError:  # the engine closed the channel without a goodbye
        if remote:
            logger.error("rank %d: node 0 went away without a goodbye", spec.rank)
        os._exit(1 if remote else 0)
    except BaseException:  # noqa: BLE001 - any failure: say why, then die (the engine sees it)
        logger.exception("worker rank %d failed", spec.rank)
        os._exit(1)
    os._exit(0)


def _serve(spec: WorkerSpec, conn) -> None:
    from quire import parallel_state as ps
    from quire.collector import collector_paused
    from quire.worker.kv_cache import KVCache
    from quire.worker.model_builder import build_model, parameter_bytes
    from quire.worker.model_runner import ModelRunner

    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    from quire.distributed.pipeline import PipelineLinks

    if spec.device_type == "cuda":
        torch.cuda.set_device(spec.local_rank)
        device = torch.device("cuda", spec.local_rank)
    else:
        device = torch.device("cpu")
    conn.send(("joining",))  # imports done: a failure before this is seen at once
    if spec.args.nnodes > 1:
        from quire.distributed.rendezvous import pin_gloo_interface
        pin_gloo_interface(spec.args.master_addr)
    ps.init_process_group(spec.rank, spec.size, spec.init_method, device,
                          tp_size=spec.tp_size)
    cfg = spec.cfg
    tp_rank = spec.rank % spec.tp_size
    with collector_paused():  # (as the engine's own load: quire/collector.py)
        model = build_model(spec.args, spec.source, cfg, spec.dtype, device,
                            spec.max_model_len, tp_rank, spec.tp_size, spec.stage)
    kv_heads = ps.kv_heads_per_rank(cfg.num_kv_heads, spec.tp_size)
    conn.send(("loaded", parameter_bytes(model)))

    num_blocks, num_host_blocks = conn.recv()
    block_size = spec.args.block_size
    num_layers = len(model.stage_layers)
    kv_cache = KVCache(num_layers, num_blocks, block_size, kv_heads, cfg.head_dim,
                       spec.kv_dtype, device)
    host_cache = None
    if num_host_blocks:
        host_cache = KVCache(num_layers, num_host_blocks, block_size, kv_heads,
                             cfg.head_dim, spec.kv_dtype, torch.device("cpu"),
                             pin_memory=device.type == "cuda")
    pipeline = PipelineLinks.of(spec.rank, spec.size, spec.tp_size, cfg, spec.dtype, device)
    runner = ModelRunner(model, kv_cache, None, block_size, device, host_cache,
                         pipeline=pipeline)
    conn.send(("ready", kv_cache.nbytes))
    while True:
        inputs = conn.recv()
        if inputs is None:  # shutdown
            break
        runner.run(inputs)
    ps.destroy_process_group()
