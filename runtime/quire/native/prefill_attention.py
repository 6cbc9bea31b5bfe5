"""Causal attention of a prefill chunk on the AMX tiles (native/prefill_attention.cpp).

    if prefill_attention.supported(q, k, v):
        prefill_attention.causal(q, k, v, out, scale)   # q/out [L, H, D], k/v [ctx, Hk, D]

The chunk's L rows are the last L of the ctx positions (a fresh prompt: ctx = L; a chunk over
a cached prefix: its gathered K/V). bfloat16 only, no window, soft-capping or sinks: the torch
backend's prefill chunks where the CPU has AMX. Float32 scores, softmax and sums;
probabilities rounded to bfloat16 for their product with V, as torch's CPU flash kernel does;
the result within a bound of a float64 reference that tests/runtime/test_prefill_attention.py
states. Elsewhere (no AMX, other dtypes, $QUIRE_AMX_ATTENTION=0) the caller keeps torch's SDPA.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from quire.native import loader

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _library(march: str = "native"):
    lib = loader.load_library("prefill_attention.cpp", march)
    if lib is None or not lib.quire_prefill_attention_ready():
        return None
    fn = lib.quire_prefill_attention
    fn.restype = _INT
    fn.argtypes = [_P, _P, _P, _P, _I64, _I64, _INT, _INT, _INT, _I64, _I64, _I64, _I64,
                   ctypes.c_float, _INT]
    return fn


def available(march: str = "native") -> bool:
    """Whether this build runs the kernel (AMX tiles the process may use) and it is not off
    ($QUIRE_AMX_ATTENTION: `1`, the default, or `0`)."""
    value = os.environ.get("QUIRE_AMX_ATTENTION", "1")
    if value not in ("0", "1"):
        raise ValueError(f"QUIRE_AMX_ATTENTION must be 0 or 1, got {value!r}")
    return value == "1" and _library(march) is not None


def _rows(t: torch.Tensor) -> bool:  # [rows, heads, D] with each row's heads contiguous
    return (t.dim() == 3 and t.dtype == torch.bfloat16 and t.device.type == "cpu"
            and t.stride(2) == 1 and t.stride(1) == t.shape[2])


def serves(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether the kernel takes chunks of q's kind: bfloat16 CPU rows [T, H, D] with D a
    multiple of 32 up to 256 and H a multiple of num_kv_heads, on a build that runs it."""
    heads, d = q.shape[-2:]
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and d % 32 == 0 and d <= 256
            and num_kv_heads > 0 and heads % num_kv_heads == 0 and available())


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (_rows(q) and _rows(k) and _rows(v) and k.shape == v.shape
            and k.shape[-1] == q.shape[-1] and k.shape[0] >= q.shape[0]
            and serves(q, k.shape[1]))


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float,
           march: str = "native") -> None:
    """out[t, h] = softmax(scale q[t, h] . k[:ctx - L + t + 1, h's KV head]) v: a chunk's
    causal attention over its ctx keys, written into out ([L, H, D], rows' heads contiguous)."""
    if not (_rows(q) and _rows(k) and _rows(v) and _rows(out)):
        raise ValueError("q, k, v and out must be bfloat16 CPU tensors [rows, heads, head_dim] "
                         "with each row's heads contiguous")
    if k.shape != v.shape or out.shape != q.shape:
        raise ValueError("k and v must share a shape, and out must have q's")
    if k.shape[0] < q.shape[0]:
        raise ValueError(f"k and v hold {k.shape[0]} positions, fewer than q's {q.shape[0]} "
                         "rows (the chunk's rows are the last of the keys' positions)")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    fn = _library(march)
    if fn is None:
        raise RuntimeError("the AMX prefill attention kernel is not available on this CPU")
    length, heads, dim = q.shape
    if fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), length, k.shape[0], heads,
          k.shape[1], dim, q.stride(0), k.stride(0), v.stride(0), out.stride(0), scale,
          torch.get_num_threads()):
        raise ValueError(f"head_dim {dim} (a multiple of 32 up to 256) and {heads} heads over "
                         f"{k.shape[1]} KV heads (a whole number each) are what it takes")
