"""The grouped experts forward for the CPU: pairs sorted by expert, one grouped matmul per
projection (or the experts' own kernels in turn, where those are faster: experts.py), the
down bias and the top-k weight applied to the down projection's output, then the combine."""

from __future__ import annotations

import torch

from quire.layers.fused_moe import activation, dispatch


def fused_experts(layer, x: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, H] (this rank's partial sum under tensor parallelism)."""
    p = dispatch.plan(topk_ids, layer.num_experts)
    h = layer.method.grouped(layer, "w13", x[p.tokens], p.counts)
    if layer.w13_bias is not None:
        h = h + layer.w13_bias[p.expert_ids]
    h = activation.apply(layer.activation, h, layer.swiglu_alpha, layer.swiglu_limit)
    y = layer.method.grouped(layer, "w2", h, p.counts)
    if layer.w2_bias is not None and layer.adds_w2_bias:
        y = y + layer.w2_bias[p.expert_ids]
    y = y * topk_weights.reshape(-1)[p.order, None]  # as transformers: after the bias
    return dispatch.combine(y, p, x.dtype)
