"""The interface every weight-only quantized matmul kernel offers (quant_kernels.py picks one
per layer). Its own module so that kernels living elsewhere (triton_quant.py, the FP8
kernels) subclass it without importing the picker, which imports them."""

from __future__ import annotations

import torch


class Kernel:
    name = "?"
    owns_weights = False  # holds its own packed copy: the canonical tensors may be freed

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight this kernel multiplies by (tests, the transformers oracle)."""
        raise NotImplementedError

    def extra_bytes(self) -> int:
        """Memory it holds beyond the layer's parameters (its packed or dequantized copy)."""
        held = [getattr(self, a, None) for a in ("weight", "packed", "scales_zeros")]
        packed = getattr(self, "packed", None)
        held += [getattr(packed, a, None) for a in ("qweight", "scales", "offsets")]
        return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """fused_ops.silu_and_mul(self(x)) of a gate|up weight in one pass, where this kernel
        fuses it (bit for bit); None: the caller takes the two steps."""
        return None
