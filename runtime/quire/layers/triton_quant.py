"""Weight-only int8 / int4 matmul for CUDA in Triton, on the canonical tensors
(quant_formats.py): y = x @ dequant(W).T, the weight dequantized tile by tile in registers.

The accumulation is fp32. The tile product runs in fp32 (`ieee`: the same values as
dequantize-then-matmul up to the order of the sums) or, for fp16/bf16 activations when
`fast=True`, in the activation dtype (each dequantized weight rounded to it first: tensor
cores, about one half-precision ulp per weight). Tested in TRITON_INTERPRET=1 against
dequantize-then-matmul (tests/quant/triton_quant_suite.py); bf16 tl.dot is wrong in the
interpreter, so the tests use fp32 and fp16 there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quant_matmul_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, G,
                         stride_xm, stride_qn, stride_sn, stride_ym,
                         INT4: tl.constexpr, DOT_FP32: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask,
                    other=0.0)
        w_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)      # [BLOCK_K, BLOCK_N]
        group = offs_k[:, None] // G
        s = tl.load(s_ptr + offs_n[None, :] * stride_sn + group, mask=w_mask, other=0.0)
        if INT4:
            byte = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None] // 2,
                           mask=w_mask, other=0)
            q = (byte.to(tl.int32) >> ((offs_k[:, None] % 2) * 4)) & 0xF
            z = tl.load(z_ptr + offs_n[None, :] * stride_sn + group, mask=w_mask, other=0.0)
            w = (q.to(tl.float32) - 8.0) * s + z
        else:
            q = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None], mask=w_mask,
                        other=0)
            w = q.to(tl.float32) * s
        w = tl.where(w_mask, w, 0.0)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None = None, fast: bool = False) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16) @ dequant(W).T -> [M, N] in x's dtype; int4 when `zeros`
    is given (qweight then [N, K//2])."""
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    group = k // scales.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    int4 = zeros is not None
    _quant_matmul_kernel[grid](
        x, qweight, scales, zeros if int4 else scales, y, m, n, k, group,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        INT4=int4, DOT_FP32=not fast or x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


class TritonQuantKernel:
    """The quant_kernels.Kernel for CUDA weights."""

    def __init__(self, kind: str, qweight, scales, zeros=None, fast: bool = False) -> None:
        self.name = f"triton-{kind}"
        self.qweight, self.scales = qweight.contiguous(), scales.float().contiguous()
        self.zeros = None if zeros is None else zeros.float().contiguous()
        self.fast = fast

    def __call__(self, x):
        return quant_matmul(x, self.qweight, self.scales, self.zeros, self.fast)


def kernel(kind: str, qweight, scales, zeros=None) -> TritonQuantKernel:
    return TritonQuantKernel(kind, qweight, scales, zeros)
