"""This process's place in the parallel group: its tensor-parallel rank and size, its
pipeline stage, and the collectives.

One world per engine, tensor x pipeline ranks: global rank = stage x tp_size + tp_rank, so
each stage's tensor-parallel ranks are consecutive. Rank 0 (stage 0, tensor rank 0) is the
engine process itself; the others are worker processes (`quire.distributed.workers`), on this
node or on others. Layers read their tensor rank and size from here while a model is built
(`shard_as`), and the model its stage's layers (`stage_as`), as vLLM's do, so a model file
never passes a process group around; each layer keeps what it read and calls a collective
only when its own size is above 1. So a size-1 model is exactly the single-process one,
whatever else lives in the process.

The all-reduces and the logits gather run in the stage's tensor group; activations go from
stage to stage by point-to-point sends in the world group (`send`, `recv`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Bounds every collective: a peer that stops answering (hung, not dead: a dead one closes its
# sockets and gloo fails at once) turns into an error instead of a hang.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    size: int = 1


_state = ParallelState()


@dataclass(frozen=True)
class PipelineStage:
    """The contiguous layers [first_layer, end_layer) one pipeline stage holds."""
    index: int = 0
    count: int = 1
    first_layer: int = 0
    end_layer: int = 1 << 30  # the whole model

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def owns(self, layer: int) -> bool:
        return self.first_layer <= layer < self.end_layer


_stage = PipelineStage()
# the collectives' group: this stage's tensor ranks (None: the whole world, when pp == 1),
# and the global rank of its tensor rank 0 (where the logits are gathered)
_tp_group = None
_tp_leader = 0


@contextlib.contextmanager
def stage_as(stage: PipelineStage):
    """A model built inside holds only this stage's layers (and the embedding on the first,
    the final norm and LM head on the last)."""
    global _stage
    old, _stage = _stage, stage
    try:
        yield
    finally:
        _stage = old


def pipeline_stage() -> PipelineStage:
    return _stage


def partition_layers(num_layers: int, pp: int, override: str | None = None) -> list[int]:
    """Layers per stage. Default: even, the remainder one each to the stages before the last
    (which also holds the LM head), as vLLM's get_pp_indices; `override` is its
    VLLM_PP_LAYER_PARTITION spelling, e.g. "5,6,6,5"."""
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp}) must be at most the model's number of "
                         f"layers ({num_layers}): every stage needs a layer")
    if override:
        try:
            counts = [int(n) for n in override.split(",")]
        except ValueError:
            raise ValueError(f"pipeline_layer_partition must be comma-separated layer counts, "
                             f"one per stage, e.g. '{num_layers - num_layers // 2},"
                             f"{num_layers // 2}'; got {override!r}") from None
        if len(counts) != pp or min(counts) < 1 or sum(counts) != num_layers:
            raise ValueError(f"pipeline_layer_partition {override!r} must give {pp} counts "
                             f"(one per stage), each >= 1, summing to the model's "
                             f"{num_layers} layers")
        return counts
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        counts[-i] += 1
    return counts


def stage_of(index: int, counts: list[int]) -> PipelineStage:
    first = sum(counts[:index])
    return PipelineStage(index, len(counts), first, first + counts[index])


@contextlib.contextmanager
def shard_as(rank: int, size: int):
    """Layers built inside take this rank's shard of a group of `size`."""
    global _state
    old, _state = _state, ParallelState(rank, size)
    try:
        yield
    finally:
        _state = old


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.size


def init_process_group(rank: int, size: int, init_method: str, device: torch.device,
                       timeout_s: float = COLLECTIVE_TIMEOUT_S, tp_size: int | None = None
                       ) -> None:
    """Join the world (blocks until all `size` ranks have): NCCL on CUDA, gloo on CPU; with
    several pipeline stages (size > tp_size), each stage's tensor group too."""
    global _tp_group, _tp_leader
    import torch.distributed as dist
    if dist.is_initialized():
        raise RuntimeError("this process is already in a tensor-parallel group: shut the "
                           "other tensor-parallel engine down first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    tp = size if tp_size is None else tp_size
    _tp_group, _tp_leader = None, 0
    if size > tp:
        for first in range(0, size, tp):  # every rank creates every group, in one order
            group = dist.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                _tp_group, _tp_leader = group, first
    logger.info("rank %d of %d joined (%s; tensor group from rank %d)", rank, size, backend,
                _tp_leader)


def destroy_process_group() -> None:
    global _tp_group, _tp_leader
    _tp_group, _tp_leader = None, 0
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group whose peer died may not tear down cleanly
            logger.debug("destroying the process group failed", exc_info=True)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the group, in place."""
    import torch.distributed as dist
    dist.all_reduce(x, group=_tp_group)
    return x


def gather_last_dim(x: torch.Tensor, rank: int, size: int) -> torch.Tensor | None:
    """Tensor rank 0 gets every tensor rank's x concatenated along the last dim; the others
    get None."""
    import torch.distributed as dist
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
    dist.gather(x, parts, dst=_tp_leader, group=_tp_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def send(x: torch.Tensor, dst: int):
    """To another stage's rank (global), without waiting: returns the work to wait on (the
    tensor must live until then)."""
    import torch.distributed as dist
    return dist.isend(x.contiguous(), dst)


def recv(x: torch.Tensor, src: int) -> torch.Tensor:
    """Fills x from another stage's rank (global); blocks until it has arrived."""
    import torch.distributed as dist
    dist.recv(x, src)
    return x


# --- attention heads -----------------------------------------------------------------------
def heads_per_rank(num_heads: int, size: int | None = None) -> int:
    size = _state.size if size is None else size
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size ({size}) must divide the model's number of "
                         f"attention heads ({num_heads})")
    return num_heads // size


def kv_heads_per_rank(num_kv_heads: int, size: int | None = None) -> int:
    """KV heads split across ranks; when there are fewer than ranks, each rank keeps the one
    its query heads use (replicated, as vLLM does)."""
    size = _state.size if size is None else size
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"tensor_parallel_size ({size}) must divide the model's number "
                             f"of KV heads ({num_kv_heads})")
        return num_kv_heads // size
    if size % num_kv_heads:
        raise ValueError(f"with fewer KV heads ({num_kv_heads}) than tensor_parallel_size "
                         f"({size}), the size must be a multiple of the KV heads")
    return 1


def kv_head_start(num_kv_heads: int, rank: int | None = None, size: int | None = None) -> int:
    """The first KV head (of the checkpoint's) that this rank holds."""
    rank = _state.rank if rank is None else rank
    size = _state.size if size is None else size
    if num_kv_heads >= size:
        return rank * (num_kv_heads // size)
    return rank * num_kv_heads // size
