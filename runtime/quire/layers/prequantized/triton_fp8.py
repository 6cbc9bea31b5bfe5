"""FP8 (e4m3fn) weights dequantized in Triton: w = fp8 * scales[n, k // B] in the activation
dtype. The bytes are decoded by bit arithmetic (sign, 4 exponent bits with bias 7, 3 mantissa
bits; exponent 0 is subnormal), so the same kernel runs in TRITON_INTERPRET=1, which has no
float8 type, and on GPUs that have none. Tested in the interpreter against torch's own
conversion (tests/quant/test_prequantized_fp8.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _e4m3_to_f32(byte):
    b = byte.to(tl.int32)
    sign = tl.where((b & 0x80) != 0, -1.0, 1.0)
    exponent = (b >> 3) & 0xF
    mantissa = (b & 0x7).to(tl.float32)
    normal = (1.0 + mantissa / 8.0) * tl.exp2((exponent - 7).to(tl.float32))
    subnormal = mantissa / 8.0 * 0.015625  # 2^-6
    return sign * tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                       B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    byte = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)
    s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_k[None, :] // B, mask=mask,
                other=0.0)
    w = _e4m3_to_f32(byte) * s
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(weight: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight: float8_e4m3fn (or its bytes as uint8) [N, K]; scales fp32 [N, ceil(K / B)]."""
    n, k = weight.shape
    block = -(-k // scales.shape[1])
    raw = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    scales = scales.float().contiguous()
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    block_n, block_k = 16, 128
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        raw, scales, out, n, k, raw.stride(0), scales.stride(0), out.stride(0),
        B=block, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
