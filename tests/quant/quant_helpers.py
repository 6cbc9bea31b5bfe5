"""Shared by the quantization tests: error bounds, tiny models written back for transformers."""

from __future__ import annotations

import torch

EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def matmul_error_bound(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
                       weight_rounding: float = 0.0) -> torch.Tensor:
    """Elementwise bound on |kernel - x @ w.T| when both sum the same fp32 products in a
    different order: Higham's gamma_K = K u / (1 - K u) times sum_k |x_k w_k| for each side
    (so 2 gamma_K), plus the output's rounding to out_dtype (one half-ulp of |y|, taken as a
    full ulp), plus `weight_rounding` (relative) where a kernel rounds the weight or its scale
    before the product (torch's ops: scales in bf16)."""
    k = x.shape[1]
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)
    mag = x.abs().double() @ w.abs().double().T
    y = (x.double() @ w.double().T).abs()
    return (2 * gamma + weight_rounding * (1 + gamma)) * mag + EPS[out_dtype] * y + 1e-30
