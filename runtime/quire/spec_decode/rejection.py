"""Verification of proposals by the standard rejection sampler (Leviathan et al. 2023; Chen et
al. 2023), so the tokens that come out are distributed exactly as the target's own samples.

For one sequence with proposals d_1..d_k, the target's (processed) distributions p_0..p_k at
the k+1 positions, and the proposer's q_1..q_k (a point mass for n-gram proposals):
    accept d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i)), in order;
    at the first rejection, emit a token drawn from normalize(max(p_{i-1} - q_i, 0)) and stop;
    when all k are accepted, emit a bonus token drawn from p_k.
Greedy rows accept d_i exactly when it is the target's argmax, and emit the argmax at the
first mismatch: the same tokens as decoding one at a time.
"""

from __future__ import annotations

import torch


def verify_greedy(target_argmax: list[int], proposals: list[int]) -> list[int]:
    """target_argmax: the argmax at each of the k+1 positions."""
    out = []
    for i, d in enumerate(proposals):
        out.append(target_argmax[i])
        if target_argmax[i] != d:
            return out
    out.append(target_argmax[len(proposals)])
    return out


def verify_sampled(probs: torch.Tensor, proposals: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """probs: [k+1, vocab] target distributions; draft_probs: [k, vocab] or None (point
    masses on the proposals). Returns the accepted proposals then one drawn token."""
    k = len(proposals)
    ids = torch.tensor(proposals, dtype=torch.long, device=probs.device)
    p = probs[:k].gather(1, ids[:, None])[:, 0]
    q = (torch.ones_like(p) if draft_probs is None
         else draft_probs.gather(1, ids[:, None])[:, 0])
    u = torch.rand(k, generator=generator, device=probs.device, dtype=probs.dtype)
    # accept while u < p / q  (written as u * q < p: no division by a zero q)
    accepted = (u * q < p).tolist()
    n = accepted.index(False) if False in accepted else k
    if n == k:
        return proposals + [_draw(probs[k], generator)]
    residual = probs[n].clone()
    if draft_probs is None:
        residual[proposals[n]] = 0.0
    else:
        residual = (residual - draft_probs[n]).clamp_(min=0.0)
    if not float(residual.sum()) > 0.0:  # p == q exactly: any draw from p is as good
        residual = probs[n]
    return proposals[:n] + [_draw(residual, generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights, 1, generator=generator))
