"""The per-expert loop: transformers' eager experts forward, expert by expert. The oracle the
grouped paths are tested against, and the baseline benchmarks/moe.py measures them by."""

from __future__ import annotations

import torch

from quire.layers.fused_moe import activation


def experts_loop(layer, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, H] (this rank's partial sum under tensor parallelism): for each expert
    that any token chose, in id order, its tokens' gate/up, activation, down (+ bias), times
    the tokens' weights, added onto zeros with index_add_."""
    out = torch.zeros_like(x)
    k = topk_ids.shape[1]
    for expert in torch.unique(topk_ids).tolist():
        # rows in transformers' order, by choice rank, then token: a row's float32 product
        # depends on its place in the matrix
        choice, tokens = torch.where((topk_ids == expert).T)
        pairs = tokens * k + choice
        h = layer.method.expert_linear(layer, "w13", expert, x[tokens])
        if layer.w13_bias is not None:
            h = h + layer.w13_bias[expert]
        h = activation.apply(layer.activation, h, layer.swiglu_alpha, layer.swiglu_limit)
        h = layer.method.expert_linear(layer, "w2", expert, h)
        if layer.w2_bias is not None and layer.adds_w2_bias:
            h = h + layer.w2_bias[expert]
        h = h * topk_weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, h.to(out.dtype))
    return out
