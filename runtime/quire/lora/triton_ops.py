"""Triton kernels for the batched LoRA delta (Punica / S-LoRA's SGMV shrink and expand).

Both kernels walk the segments of a `LoRABatch`: program (segment, row tile[, column tile])
reads its segment's slot once and multiplies that tile of rows by the slot's matrices.

    shrink: u[i] = x[perm[i]] @ lora_a[slot]            u: [rows with an adapter, width]
    expand: y[perm[i]] += u[i] @ lora_b[slot]           in place; each row in one segment

u is rounded to the activation dtype between the two, and the delta before it is added, as
the torch path does. Checked against it in TRITON_INTERPRET=1 (tests/lora/
triton_interpreter_suite.py). Tile sizes are untuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quire.attention.triton_kernels.common import dot_config
from quire.lora.batch import LoRABatch

BLOCK_M = 16   # rows per tile: decode segments are short
BLOCK_K = 64   # input features per step of the shrink
BLOCK_N = 64   # output features per expand program


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, u_ptr, perm_ptr, seg_starts_ptr, seg_slots_ptr, K, R,
                   stride_xm, stride_xk, stride_as, stride_ak, stride_ar, stride_um, stride_ur,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < end
    rows = tl.load(perm_ptr + m, mask=m_ok, other=0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptr + slot * stride_as + k[:, None] * stride_ak + r[None, :] * stride_ar,
                     mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.dot(xt.to(DOT_DTYPE), at.to(DOT_DTYPE), input_precision=PRECISION)
    tl.store(u_ptr + m[:, None] * stride_um + r[None, :] * stride_ur,
             acc.to(u_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(u_ptr, b_ptr, y_ptr, perm_ptr, seg_starts_ptr, seg_slots_ptr, N, R,
                   stride_um, stride_ur, stride_bs, stride_br, stride_bn, stride_ym, stride_yn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < end
    rows = tl.load(perm_ptr + m, mask=m_ok, other=0)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    ut = tl.load(u_ptr + m[:, None] * stride_um + r[None, :] * stride_ur,
                 mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    bt = tl.load(b_ptr + slot * stride_bs + r[:, None] * stride_br + n[None, :] * stride_bn,
                 mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    delta = tl.dot(ut.to(DOT_DTYPE), bt.to(DOT_DTYPE), input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + n[None, :] * stride_yn
    ok = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=ok, other=0.0)
    delta = delta.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=ok)


def _block_r(width: int) -> int:
    return max(16, triton.next_power_of_2(width))  # tl.dot needs 16 on a GPU


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    width = lora_a.shape[2]
    u = torch.empty(batch.num_rows, width, dtype=x.dtype, device=x.device)
    dot_dtype, precision = dot_config(x.dtype)
    grid = (len(batch.segments), triton.cdiv(batch.max_segment, BLOCK_M))
    _shrink_kernel[grid](
        x, lora_a, u, batch.perm, batch.seg_starts, batch.seg_slots, x.shape[1], width,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        u.stride(0), u.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=_block_r(width), DOT_DTYPE=dot_dtype,
        PRECISION=precision)
    return u


def lora_expand(y: torch.Tensor, u: torch.Tensor, lora_b: torch.Tensor,
                batch: LoRABatch) -> torch.Tensor:
    width, n = lora_b.shape[1], lora_b.shape[2]
    dot_dtype, precision = dot_config(y.dtype)
    grid = (len(batch.segments), triton.cdiv(batch.max_segment, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _expand_kernel[grid](
        u, lora_b, y, batch.perm, batch.seg_starts, batch.seg_slots, n, width,
        u.stride(0), u.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=_block_r(width), DOT_DTYPE=dot_dtype,
        PRECISION=precision)
    return y


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    return lora_expand(y, lora_shrink(x, lora_a, batch), lora_b, batch)
