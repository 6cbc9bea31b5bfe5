"""Checkpoint tensors as the loaders hand them over: a torch.Tensor, or a lazy safetensors
slice (`safe_open(...).get_slice(name)`) that reads from disk only the part indexed. A layer's
weight_loader narrows either to its shard, so a tensor-parallel rank never reads the rest."""

from __future__ import annotations

import torch


def shape_of(t) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


def narrow(t, dim: int, start: int, length: int):
    """Rows (dim 0) or columns (dim 1) [start, start + length) of t, still lazy if t was."""
    if isinstance(t, torch.Tensor):
        return t.narrow(dim, start, length)
    index = [slice(None)] * len(shape_of(t))
    index[dim] = slice(start, start + length)
    return t[tuple(index)]  # a safetensors slice reads just this part into a tensor


def materialize(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t[:]
