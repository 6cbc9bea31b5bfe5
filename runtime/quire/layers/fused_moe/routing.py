"""Routers: a token's router logits -> its top-k experts and their weights.

Each function follows its family's transformers operation order, so that in float32 the
experts chosen and the weights are the very same numbers (a tie or a last-bit difference in a
weight would change the token's output, not just round it).
"""

from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool,
                 weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral, Qwen3-MoE: softmax over all experts in float32, the k largest, optionally
    renormalized to sum to 1 (Mixtral always; Qwen3-MoE when `norm_topk_prob`).
    `weights_dtype`: Qwen3-MoE casts the weights back to the logits' dtype, Mixtral keeps
    float32. Returns (weights [T, k], expert ids [T, k] int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        weights = weights.to(weights_dtype)
    return weights, ids


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: the k largest logits (its router has a bias, already in them), then a softmax
    over just those k, in the logits' dtype."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=1, dtype=values.dtype), ids
