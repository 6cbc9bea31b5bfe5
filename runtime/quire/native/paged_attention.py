"""The paged attention kernel for the CPU (paged_decode.cpp: decode, and the paged extend of
prefill chunks that paged_extend.py wraps), built and loaded by quire.native.loader like the
other native kernels (QUIRE_CPU_KERNELS=0 turns it off; the torch backend then keeps its
pure-torch path)."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from quire.native import loader

SOURCE = os.path.join(os.path.dirname(__file__), "paged_decode.cpp")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def paged_decode_library(march: str = "native") -> ctypes.CDLL | None:
    """paged_decode.cpp built (loader.load_library: one copy per process and `march`), or
    None where it does not build."""
    return loader.load_library(SOURCE, march)


@functools.cache
def _library(march: str = "native"):
    lib = paged_decode_library(march)
    if lib is None:
        return None
    fn = lib.quire_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [
        ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
        ctypes.c_float, ctypes.c_void_p]
    return fn


def native_decode_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in _DTYPE_CODES and k_cache.dtype == q.dtype
            and _library() is not None)


def sinks_arg(sinks: torch.Tensor | None, num_heads: int) -> tuple[torch.Tensor | None, int]:
    """(the float32 contiguous tensor to keep alive during the call, its address or 0)."""
    if sinks is None:
        return None, 0
    sinks = sinks.to(torch.float32).contiguous()
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must have shape ({num_heads},), got {tuple(sinks.shape)}")
    return sinks, sinks.data_ptr()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, window: int | None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None, _march: str = "native") -> None:
    """out[i] = attention of q[i] (one token) over the first seq_lens[i] tokens of sequence i,
    read through block_tables[i], with soft-capping and sinks where given (base.py).
    q/out [n, H, D] with contiguous rows; caches [num_blocks, block_size, Hkv, D] contiguous;
    block_tables/seq_lens int32; sinks [H]. `_march` (tests) runs a build for an older CPU:
    "haswell" the AVX2 path, "x86-64" the plain C++ one."""
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    seq_lens = seq_lens.contiguous()
    sinks, sinks_ptr = sinks_arg(sinks, num_heads)
    rc = _library(_march)(_DTYPE_CODES[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                    out.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), n, num_heads,
                    num_kv_heads, head_dim, block_size, q.stride(0), out.stride(0),
                    block_tables.stride(0), scale, window or 0, softcap or 0.0, sinks_ptr)
    if rc:
        raise RuntimeError(f"paged_decode: unsupported dtype {q.dtype}")
