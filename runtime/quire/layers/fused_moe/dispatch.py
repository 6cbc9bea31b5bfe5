"""Tokens sorted by expert, and the weighted outputs summed back per token.

A batch of T tokens with top-k routing has S = T * k (token, expert) pairs; pair p = t * k + j
is token t's j-th choice. Sorting the pairs by expert makes each expert's rows one contiguous
run, so one grouped matmul per projection covers every expert. The sort is transformers' own
call (torch.sort, not stable): a row's float32 product depends on where it sits in its
expert's matrix, so a batch that is one sequence then gets transformers' very sums. The combine puts
each pair's weighted output back in pair order and sums a token's k outputs in top-k order,
which is transformers' own order (its default grouped_mm experts: `weighted.view(T, k,
H).sum(1)`; its eager loop adds the experts in id order onto zeros, the same sum for k = 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertPlan:
    order: torch.Tensor        # [S] pair ids, grouped by expert (ascending)
    tokens: torch.Tensor       # [S] the token of each sorted pair (order // k)
    expert_ids: torch.Tensor   # [S] the expert of each sorted pair
    offsets: torch.Tensor      # [E] int32: end of each expert's run (grouped_mm's offs)
    counts: list[int]          # [E] rows per expert, on the host (the CPU paths loop on it)
    num_tokens: int
    top_k: int


def plan(topk_ids: torch.Tensor, num_experts: int) -> ExpertPlan:
    """topk_ids [T, k] -> the sorted pairs. Reads the counts back to the host (one sync):
    for the CPU paths only; the Triton path sorts on the device (triton_moe.align)."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    expert_ids, order = torch.sort(flat)
    counts = torch.bincount(flat, minlength=num_experts)
    return ExpertPlan(order, order // top_k, expert_ids,
                      torch.cumsum(counts, 0, dtype=torch.int32), counts.tolist(), num_tokens,
                      top_k)


def combine(weighted: torch.Tensor, p: ExpertPlan, dtype: torch.dtype) -> torch.Tensor:
    """weighted [S, H] in sorted order (each row already times its top-k weight) -> [T, H]:
    back to pair order, a token's k rows summed in top-k order, cast to `dtype`."""
    pairs = torch.empty_like(weighted)
    pairs[p.order] = weighted
    out = pairs.view(p.num_tokens, p.top_k, -1).sum(dim=1) if p.top_k > 1 else pairs
    return out.to(dtype)
