"""Batched prefill chunks that extend a cached prefix, on the CPU: every query row of every such
chunk attends, in one native call, to its own sequence's first (position + 1) tokens read in
place through the block table (native/paged_decode.cpp, quire_paged_extend: the decode
kernel with a row -> sequence map). On AVX2 and AVX-512 it takes up to 16 consecutive rows of
a sequence as one tile, GEMM-shaped: each K/V block is loaded (and its keys transposed) once for all the
tile's query vectors. The chunk's own K/V are already in the cache, so the cached prefix and
the causal part are one read. The torch backend's per-sequence SDPA path (its float32 eager
path with soft-capping or sinks) is the fallback, and the reference the tests compare with.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from quire import platform
from quire.attention.base import AttentionMetadata
from quire.native import paged_attention


@functools.cache
def _library(march: str = "native"):
    """quire_paged_extend; `march` other than native (tests) builds for an older CPU."""
    lib = paged_attention.paged_decode_library(march)
    if lib is None:
        return None
    fn = lib.quire_paged_extend
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [
        ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
    return fn


def supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return paged_attention.native_decode_supported(q, k_cache) and _library() is not None


# Where the CPU has a bfloat16 dot product (AVX512-BF16, AMX), a bfloat16 chunk of at least
# this many new rows is faster through SDPA, whose GEMMs multiply bfloat16 pairs at twice the
# float32 rate, than through the tiles, which widen K and V to float32 (AMX builds send such
# chunks to their own prefill kernel first). benchmarks/prefill_attention.py on the 2-core
# AMX Xeon with QUIRE_CPU_ISA=avx512_bf16 and ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (a CPU
# without AMX; SmolLM2's heads; HISTORY.md, session 26): 16 new rows over 2,048 tokens 469 us
# tiled against SDPA's 560, 32 rows 792 against 697, fresh prompts of 64 and 256 tokens 1.21x
# and 0.78x. float32 tiles were ahead of SDPA at every length measured (fresh 2,048 1.05x,
# 256 rows over 2,048 1.12x). On AMD's Zen 4 (AVX512-BF16, no AMX) SDPA in bfloat16 lost at
# every length: the same script, fresh 128 / 512 / 2,048 tokens 595 / 6434 / 55549 us against
# the tiles' 229 / 2649 / 37355, 16 / 64 / 256 rows over 2,048 1983 / 4640 / 14639 against
# 695 / 2607 / 9278 (HISTORY.md, session 33), so there every chunk stays on the tiles.
BF16_DOT_SDPA_MIN_ROWS = 24


@functools.cache
def _tiled(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
           march: str = "native") -> bool:
    lib = paged_attention.paged_decode_library(march)
    return lib is not None and bool(lib.quire_paged_extend_tiled(
        num_heads, num_kv_heads, head_dim, block_size))


def tiled(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel runs this layout in GEMM-shaped tiles of rows (the fixed shapes, on
    every build with AVX2 or AVX-512); elsewhere it walks each row alone and long chunks are
    faster through SDPA."""
    return _tiled(q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1])


def sdpa_min_rows(q: torch.Tensor) -> int | None:
    """Where the kernel tiles: None if its tiles beat SDPA on chunks of q's kind at every
    length, else the new rows from which a chunk, fresh or over a cached prefix, is faster
    through SDPA (bfloat16 on a CPU with a bfloat16 dot product, except AMD's)."""
    sdpa_bf16 = (q.dtype == torch.bfloat16 and platform.cpu_has_native_bf16()
                 and platform.cpu_vendor() != "AuthenticAMD")
    return BF16_DOT_SDPA_MIN_ROWS if sdpa_bf16 else None


def extend_rows(meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, ...]:
    """(query rows, their sequence, tokens each attends to) for the chunks of `seqs`, int32."""
    rows, row_seq, row_lens = [], [], []
    for i in seqs:
        q0, q1, ctx = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1], \
            meta.seq_lens_cpu[i]
        rows.append(np.arange(q0, q1, dtype=np.int32))
        row_seq.append(np.full(q1 - q0, i, dtype=np.int32))
        row_lens.append(np.arange(ctx - (q1 - q0) + 1, ctx + 1, dtype=np.int32))
    return tuple(torch.from_numpy(np.concatenate(a)) for a in (rows, row_seq, row_lens))


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor,
                 row_seq: torch.Tensor, row_lens: torch.Tensor, scale: float,
                 window: int | None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> None:
    """out[rows[j]] = attention of q[rows[j]] over the first row_lens[j] tokens of sequence
    row_seq[j], with soft-capping and sinks where given (base.py). q/out [T, H, D] with
    contiguous heads; caches contiguous; int32 indices; sinks [H]."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
    assert block_tables.dtype == rows.dtype == row_seq.dtype == row_lens.dtype == torch.int32
    sinks, sinks_ptr = paged_attention.sinks_arg(sinks, num_heads)
    rc = _library()(0 if q.dtype == torch.float32 else 1, q.data_ptr(), k_cache.data_ptr(),
                    v_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(),
                    row_lens.data_ptr(), len(rows), num_heads, num_kv_heads, head_dim,
                    block_size, q.stride(0), out.stride(0), block_tables.stride(0), scale,
                    window or 0, rows.data_ptr(), row_seq.data_ptr(), softcap or 0.0,
                    sinks_ptr)
    if rc:
        raise RuntimeError(f"paged_extend: unsupported dtype {q.dtype}")
