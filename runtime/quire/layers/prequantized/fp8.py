"""FP8 (e4m3) weights, kept in 8 bits: the canonical form every FP8 checkpoint is read into,
and the kernels that multiply by it.

    weight  float8_e4m3fn [N, K]
    scales  float32 [N, ceil(K / B)]   w[n, k] = float(weight[n, k]) * scales[n, k // B]

B = K for per-tensor and per-channel scales (a per-tensor scale is repeated over its part's
rows), B = 128 for 128x128 blocks (each block's scale repeated over its 128 rows).

Kernels:
- CPU: weight-only. Each call widens a tile of rows to the activation dtype (one fp32
  product per weight, exactly the checkpoint library's dequantized value, rounded once to
  bf16 in a bf16 model) and multiplies; the whole weight is never widened at once. The
  checkpoint's activation scales are not applied (as vLLM's weight-only FP8 fallback).
- CUDA: torch._scaled_mm (FP8 tensor cores: compute capability 8.9+) with per-channel or
  per-tensor weight scales and the checkpoint's static activation scale, or a dynamic
  per-token one; block scales, older GPUs and fp32 activations dequantize tiles in Triton
  (triton_fp8.py) and multiply in the activation dtype.
"""

from __future__ import annotations

import logging

import torch

from quire.layers.quant_kernel_base import Kernel

logger = logging.getLogger(__name__)

FP8 = "fp8"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE_ELEMENTS = 1 << 20  # weights widened at once on the CPU: 4 MiB of fp32


def dequantize(weight: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    block = -(-weight.shape[1] // scales.shape[1])
    s = scales.float().repeat_interleave(block, dim=1)[:, : weight.shape[1]]
    return (weight.float() * s).to(dtype)


class Fp8WidenKernel(Kernel):
    """CPU (and the reference): widen a tile of rows, multiply, next tile."""

    name = "fp8-widen"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        self.weight, self.scales = weight.contiguous(), scales.float().contiguous()
        self.rows = max(1, TILE_ELEMENTS // weight.shape[1])

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.weight, self.scales)

    def extra_bytes(self) -> int:
        return 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.weight.shape[0]
        if n <= self.rows:
            return x @ dequantize(self.weight, self.scales, x.dtype).T
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for start in range(0, n, self.rows):
            stop = min(start + self.rows, n)
            w = dequantize(self.weight[start:stop], self.scales[start:stop], x.dtype)
            torch.matmul(x, w.T, out=y[:, start:stop])
        return y


class Fp8TritonKernel(Fp8WidenKernel):
    """CUDA without FP8 GEMMs for this weight: dequantize in Triton, multiply in x's dtype."""

    name = "triton-fp8"

    def __call__(self, x):
        from quire.layers.prequantized import triton_fp8
        return x @ triton_fp8.dequantize(self.weight, self.scales, x.dtype).T


class Fp8ScaledMMKernel(Fp8WidenKernel):
    """torch._scaled_mm: x quantized to FP8 per token (dynamic) or by the checkpoint's static
    scale, rowwise weight scales (per channel; a per-tensor scale repeated)."""

    name = "scaled-mm-fp8"

    def __init__(self, weight, scales, input_scale: torch.Tensor | None) -> None:
        super().__init__(weight, scales)
        self.weight_t = self.weight.T  # column-major, as _scaled_mm wants its second operand
        self.scale_b = self.scales.reshape(1, -1).contiguous()
        self.input_scale = None if input_scale is None else input_scale.float().reshape(1, 1)

    def __call__(self, x):
        if x.dtype == torch.float32:
            return Fp8TritonKernel.__call__(self, x)
        if self.input_scale is not None:
            scale_a = self.input_scale.expand(x.shape[0], 1).contiguous()
        else:
            scale_a = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_(min=1e-12)
        xq = (x.float() / scale_a).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return torch._scaled_mm(xq, self.weight_t, scale_a=scale_a, scale_b=self.scale_b,
                                out_dtype=x.dtype)


def _scaled_mm_ok(weight: torch.Tensor, scales: torch.Tensor) -> bool:
    if not (weight.is_cuda and hasattr(torch, "_scaled_mm") and scales.shape[1] == 1):
        return False
    n, k = weight.shape
    return torch.cuda.get_device_capability(weight.device) >= (8, 9) and n % 16 == 0 \
        and k % 16 == 0


def kernel(weight: torch.Tensor, scales: torch.Tensor,
           input_scale: torch.Tensor | None = None) -> Kernel:
    if not weight.is_cuda:
        return Fp8WidenKernel(weight, scales)
    if _scaled_mm_ok(weight, scales):
        candidate = Fp8ScaledMMKernel(weight, scales, input_scale)
        try:  # probe once: some builds lack rowwise scaling for this GPU
            x = torch.randn(16, weight.shape[1], device=weight.device, dtype=torch.bfloat16)
            candidate(x)
            return candidate
        except (RuntimeError, NotImplementedError) as e:
            logger.info("torch._scaled_mm unavailable here (%s); FP8 dequantized in Triton", e)
    return Fp8TritonKernel(weight, scales)
