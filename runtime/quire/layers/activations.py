"""Gated MLP activations over a fused gate|up projection, in transformers' operation order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quire.native.fused_ops import silu_and_mul


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate, tanh approximation) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"silu": silu_and_mul, "swish": silu_and_mul,
               "gelu_pytorch_tanh": gelu_tanh_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def gated_activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden activation {name!r} is not supported; supported: "
                         f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]
