"""The decoder layer's element-wise ops, fused: residual add + RMSNorm, RoPE in place on q/k,
SiLU-and-mul.

On CPU, in float32 or bfloat16, they run the native kernels of
quire/native/fused_ops.cpp (one pass over the rows instead of a handful of
torch ops and their temporaries); elsewhere, or where that library could not be built, the
torch functions below, which are the reference: the native ones are bit-identical to them
(tests/runtime/test_fused_ops.py), and these are transformers' own operations in its order.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F

from quire.native import loader

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# The Vectorized<float> lanes of torch's sum and silu kernels, and the Sleef exp silu calls,
# per CPU capability: those two kernels are not among the few torch registers for AVX-512,
# so an AVX-512 CPU runs their AVX2 build (8 lanes), as the bit-equality tests confirm.
_WIDTHS = {"AVX512": (8, "Sleef_expf8_u10"), "AVX2": (8, "Sleef_expf8_u10")}


# --- the torch references (transformers' operation order) ---------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- the native kernels ---------------------------------------------------------------------

@functools.cache
def _native():
    """(library, vector width, Sleef exp address) or None."""
    width, exp_name = _WIDTHS.get(torch.backends.cpu.get_cpu_capability(), (0, ""))
    lib = loader.load_library("fused_ops.cpp") if width else None
    if lib is None or not lib.quire_fused_supports_width(width):
        return None
    lib.quire_rms_norm.argtypes = [_INT, _INT, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F]
    lib.quire_rope.argtypes = [_INT, _P, _P, _P, _I64, _INT, _INT, _I64, _I64]
    lib.quire_silu_and_mul.argtypes = [_INT, _INT, _P, _P, _I64, _I64, _I64, _I64, _P]
    lib.quire_argmax_rows.argtypes = [_INT, _P, _I64, _I64, _I64, _P]
    # (no exp: silu keeps the torch path; the others do not need it)
    return lib, width, _torch_function(exp_name)


def _torch_function(name: str) -> int | None:
    """The address of a function libtorch_cpu exports (its Sleef functions), or None."""
    try:
        torch_lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib",
                                             "libtorch_cpu.so"))
        return ctypes.cast(getattr(torch_lib, name), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _usable(*tensors: torch.Tensor) -> bool:
    t = tensors[0]
    return (t.device.type == "cpu" and t.dtype in _DTYPE_CODES
            and all(x.dtype == t.dtype and x.stride(-1) == 1 for x in tensors)
            and _native() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm_ref(x); with a residual, first residual += x (in place) and normalize that,
    the result overwriting x (a temporary there: the previous layer's output) instead of a
    new tensor. x/residual [T, N]."""
    if x.dim() != 2 or not _usable(x, weight, *(() if residual is None else (residual,))) \
            or not weight.is_contiguous():
        if residual is None:
            return rms_norm_ref(x, weight, eps)
        residual.add_(x)
        return rms_norm_ref(residual, weight, eps)
    lib, width, _ = _native()
    out = torch.empty_like(x) if residual is None else x  # the kernel reads a row first
    rows, n = x.shape
    rc = lib.quire_rms_norm(_DTYPE_CODES[x.dtype], width, x.data_ptr(),
                            None if residual is None else residual.data_ptr(),
                            weight.data_ptr(), out.data_ptr(), rows, n, x.stride(0),
                            0 if residual is None else residual.stride(0), out.stride(0),
                            eps)
    if rc:  # a row too long for the kernel's stack buffer
        if residual is None:
            return rms_norm_ref(x, weight, eps)
        residual.add_(x)
        return rms_norm_ref(residual, weight, eps)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope_ref(x) written into x (a [T, H, D] view whose heads are contiguous)."""
    t, heads, d = x.shape
    if not _usable(x, cos, sin) or x.stride(1) != d or cos.stride(0) != sin.stride(0) \
            or cos.dtype != x.dtype:
        x.copy_(rope_ref(x, cos, sin))
        return x
    lib, _, _ = _native()
    lib.quire_rope(_DTYPE_CODES[x.dtype], x.data_ptr(), cos.data_ptr(), sin.data_ptr(), t,
                   heads, d, x.stride(0), cos.stride(0))
    return x


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope_ on the first cos.shape[-1] dims of each head (all of them, usually; fewer under
    partial rotary, as Phi-3 and transformers' apply_rotary_pos_emb do), in place."""
    if cos.shape[-1] == x.shape[-1]:
        return rope_(x, cos, sin)
    part = x[..., : cos.shape[-1]]
    part.copy_(rope_ref(part, cos, sin))
    return x


@functools.cache
def bf16_exp16() -> int | None:
    """The address of Sleef's 16-lane exp where it gives the bits of the 8-lane one torch's
    silu calls on every bfloat16 input (checked here, once, on all 65,536 of them), else
    None: a kernel over bfloat16 values may call it instead, at about a third of the cost."""
    native = _native()
    exp16 = _torch_function("Sleef_expf16_u10")
    if native is None or native[2] is None or exp16 is None:
        return None
    native[0].quire_exp16_matches_exp8.argtypes = [_P, _P]
    return exp16 if native[0].quire_exp16_matches_exp8(native[2], exp16) else None


def bf16_silu_exp(n: int) -> tuple[int, int] | None:
    """For a kernel that computes silu_and_mul of bfloat16 rows of n itself (a matmul's
    epilogue): (bf16_exp16(), where torch's silu stops vectorizing such a row: the rest takes
    std::exp), so that it gives this module's bits; None where bf16_exp16 is None."""
    exp16 = bf16_exp16()
    if exp16 is None:
        return None
    step = 2 * (_native()[1] * 4 // 2)  # 2 * Vectorized<BFloat16>::size()
    return exp16, n // step * step


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_and_mul_ref: gate_up [T, 2 * N] -> [T, N]."""
    if gate_up.dim() != 2 or not _usable(gate_up) or _native()[2] is None:
        return silu_and_mul_ref(gate_up)
    lib, width, exp_fn = _native()
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, n)
    if lib.quire_silu_and_mul(_DTYPE_CODES[gate_up.dtype], width, gate_up.data_ptr(),
                              out.data_ptr(), rows, n, gate_up.stride(0), n, exp_fn):
        return silu_and_mul_ref(gate_up)  # a row too long for the kernel's stack buffer
    return out


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """logits.max(dim=-1).indices.tolist() for [rows, vocab] logits: each row's first maximum
    (a NaN's index where the row has one), by the native kernel where it runs (CPU tensors),
    else by torch."""
    if logits.dim() != 2 or not _usable(logits) or not logits.shape[1]:
        return logits.max(dim=-1).indices.tolist()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _native()[0].quire_argmax_rows(_DTYPE_CODES[logits.dtype], logits.data_ptr(),
                                   logits.shape[0], logits.shape[1], logits.stride(0),
                                   out.data_ptr())
    return out.tolist()
