"""This process's place in the tensor-parallel group: rank, size, and the collectives.

One group per engine: rank 0 is the engine process itself, ranks 1..N-1 are worker processes
(see `quire.distributed.workers`). Layers read their rank and size from here while a model is
built (`shard_as`), as vLLM's do, so a model file never passes a process group around; each
layer keeps what it read and calls a collective only when its own size is above 1. So a
size-1 model is exactly the single-process one, whatever else lives in the process.
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
                       timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """Join the group (blocks until all `size` ranks have): NCCL on CUDA, gloo on CPU."""
    import torch.distributed as dist
    if dist.is_initialized():
        raise RuntimeError("this process is already in a tensor-parallel group: shut the "
                           "other tensor-parallel engine down first")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("tensor-parallel rank %d of %d joined (%s)", rank, size, backend)


def destroy_process_group() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group whose peer died may not tear down cleanly
            logger.debug("destroying the process group failed", exc_info=True)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the group, in place."""
    import torch.distributed as dist
    dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor, rank: int, size: int) -> torch.Tensor | None:
    """Rank 0 gets every rank's x concatenated along the last dim; the others get None."""
    import torch.distributed as dist
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


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
