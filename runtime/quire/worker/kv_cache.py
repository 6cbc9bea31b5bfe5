"""The KV tensors: one pool of blocks for every layer, sized from a memory budget; and the
byte moves between them and the KV tiers (quire/kv_tiers): a block's payload is its K and V
in every layer, [layers, 2, block_size, kv heads, head dim], contiguous, as raw bytes."""

from __future__ import annotations

import logging
import math
import mmap
from concurrent.futures import ThreadPoolExecutor

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
    """On the CPU, zeros the OS provides on first touch, so a cache costs memory and time only
    as its blocks are used: torch.zeros writes every page up front, 2-4 s and the whole
    resident set for the default 4 GiB. A shared anonymous mapping, not a private one
    (calloc's): a page is often read before it is first written (a block's 6 KiB straddle
    pages, and attention reads the block before), and a private page first read is the
    kernel's zero page, so the write then costs a copy-on-write fault (4 us against 0.8 after
    a read here; the first fault, read or write, ~2-3 us).
    The pool hands out never-used blocks first, so a fresh server pays this on every new
    page: a batch-32 decode step's KV write 2.07 -> 0.75 ms (0.32 with every page touched),
    serving 32 users +4-9% (benchmarks/README.md, AMX Xeon). Spawned workers never share it;
    a fork + exec drops it. 64-byte aligned (a page is), as torch's own allocator is."""
    if device.type != "cpu" or pin_memory:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    nbytes = math.prod(shape) * dtype.itemsize
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)[:nbytes]
    return torch.from_numpy(raw).view(dtype).view(shape)


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
        self.tier_sink = None  # callable(entries, payloads): the KV tier chain's store
        self._offload = None   # CUDA: the side stream and thread that copy blocks out

    @property
    def block_nbytes(self) -> int:
        return self.nbytes // self.num_blocks

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

    # --- KV tiers ----------------------------------------------------------------------------
    def load_blocks(self, loads: list[tuple[int, bytes]]) -> None:
        """Write tier payloads into their pool blocks (before the step's forward)."""
        if not loads:
            return
        size = self.block_nbytes
        for block_id, payload in loads:
            if len(payload) != size:
                raise ValueError(f"a KV tier payload of {len(payload)} bytes for block "
                                 f"{block_id}; a block holds {size}")
        buf = bytearray(b"".join(p for _, p in loads))  # writable: torch.frombuffer wants it
        host = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype)
        host = host.view(len(loads), *self._block_shape()).permute(1, 2, 0, 3, 4, 5)
        ids = torch.tensor([b for b, _ in loads], device=self.kv.device)
        self.kv[:, :, ids] = host.to(self.kv.device, non_blocking=False)

    def offload_blocks(self, entries: list) -> None:
        """Copy blocks out to the tiers (after the step's forward filled them). On CUDA the
        gather runs on a side stream that the next step waits for, and the device-to-host
        copy and the tier stores finish on a thread: off the step's critical path."""
        if not entries or self.tier_sink is None:
            return
        ids = torch.tensor([e.block_id for e in entries], device=self.kv.device)
        if self.kv.device.type != "cuda":
            self.tier_sink(entries, self._payloads(self.kv[:, :, ids]))
            return
        if self._offload is None:
            self._offload = (torch.cuda.Stream(self.kv.device), ThreadPoolExecutor(1))
        stream, pool = self._offload
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            gathered = self.kv[:, :, ids].permute(2, 0, 1, 3, 4, 5).contiguous()
            gathered_done = torch.cuda.Event()
            gathered_done.record(stream)
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        # the next forward may overwrite these blocks: it waits for the gather only
        torch.cuda.current_stream(self.kv.device).wait_event(gathered_done)

        def finish() -> None:
            copied.synchronize()
            self.tier_sink(entries, _split(host))
        pool.submit(finish)

    def flush_offloads(self) -> None:
        """Wait for copies still on their way to the tiers (CUDA)."""
        if self._offload is not None:
            self._offload[1].submit(lambda: None).result()

    def _block_shape(self) -> tuple[int, ...]:
        return (self.kv.shape[0], 2, *self.kv.shape[3:])

    def _payloads(self, blocks: torch.Tensor) -> list[bytes]:
        """[layers, 2, n, ...] -> one bytes object per block."""
        return _split(blocks.permute(2, 0, 1, 3, 4, 5).contiguous().cpu())


def _split(blocks: torch.Tensor) -> list[bytes]:
    raw = blocks.view(torch.uint8).reshape(blocks.shape[0], -1).numpy()
    return [row.tobytes() for row in raw]


