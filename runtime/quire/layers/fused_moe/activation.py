"""The experts' gated activations, on the gate/up projection's output [S, 2 * I] laid out as
[gate | up] (a checkpoint that interleaves them, gpt-oss, is de-interleaved on load)."""

from __future__ import annotations

import torch

from quire.native.fused_ops import silu_and_mul

SILU = "silu"            # Mixtral, Qwen3-MoE: silu(gate) * up
SWIGLU_OAI = "swigluoai"  # gpt-oss: clamped, (up + 1) * gate * sigmoid(alpha * gate)
ACTIVATIONS = (SILU, SWIGLU_OAI)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """transformers' GptOssExperts._apply_gate, operation for operation."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def apply(kind: str, gate_up: torch.Tensor, alpha: float = 1.702,
          limit: float = 7.0) -> torch.Tensor:
    if kind == SILU:
        return silu_and_mul(gate_up)
    if kind == SWIGLU_OAI:
        return swiglu_oai(gate_up, alpha, limit)
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {kind!r}")
