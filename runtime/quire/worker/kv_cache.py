"""The KV tensors: one pool of blocks for every layer, sized from a memory budget."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

logger = logging.getLogger(__name__)

KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_CPU_DEFAULT_FRACTION = 0.25
_CPU_DEFAULT_CAP = 4 << 30
_CUDA_DEFAULT_FRACTION = 0.9


def kv_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return KV_DTYPES.get(kv_cache_dtype, model_dtype)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def kv_budget(device: torch.device, kv_cache_memory: int | None,
              fraction: float | None) -> int:
    if kv_cache_memory is not None:
        return kv_cache_memory
    free = free_device_memory(device)
    if device.type == "cuda":
        return int(free * (fraction or _CUDA_DEFAULT_FRACTION))
    if fraction is not None:
        return int(free * fraction)
    return min(int(free * _CPU_DEFAULT_FRACTION), _CPU_DEFAULT_CAP)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           pin_memory: bool) -> torch.Tensor:
    """On the CPU, zeros the OS provides on first touch (calloc: mmap'd zero pages), so a
    cache costs memory and time only as its blocks are used: torch.zeros writes every page
    up front, 2-4 s and the whole resident set for the default 4 GiB. 64-byte aligned, as
    torch's own allocator is."""
    if device.type != "cpu" or pin_memory:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


class KVCache:
    """k/v for layer i are `self.kv[i, 0]` / `self.kv[i, 1]`, each
    [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 pin_memory: bool = False) -> None:
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        # zeros, not empty: padded gathers read unused slots, and garbage could be NaN
        self.kv = _zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
                         dtype, device, pin_memory)
        self.layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def swap(self, host: KVCache, swap_out: list[tuple[int, int]],
             swap_in: list[tuple[int, int]]) -> None:
        """Out first: blocks freed by a swap-out may be handed to a swap-in in the same step."""
        if swap_out:
            src, dst = zip(*swap_out)
            host.kv[:, :, list(dst)] = self.kv[:, :, list(src)].to(host.kv.device)
        if swap_in:
            src, dst = zip(*swap_in)
            self.kv[:, :, list(dst)] = host.kv[:, :, list(src)].to(self.kv.device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: whole blocks, every layer, K and V, in one indexed copy."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.kv.device)
        dst = torch.tensor([d for _, d in pairs], device=self.kv.device)
        self.kv[:, :, dst] = self.kv[:, :, src]
