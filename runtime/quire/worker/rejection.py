"""Verification of proposals by the standard rejection sampler (Leviathan et al. 2023; Chen et
al. 2023), so the tokens that come out are distributed exactly as the target's own samples.

For one sequence with proposals d_1..d_k and the target's (processed) distributions p_0..p_k
at the k+1 positions, with deterministic proposals (n-gram lookups and greedy drafts: q_i is a
point mass on d_i):
    accept d_i with probability p_{i-1}(d_i) (= min(1, p/q)), in order;
    at the first rejection, emit a token drawn from p_{i-1} with d_i removed, renormalised
    (= normalize(max(p - q, 0))), and stop;
    when all k are accepted, emit a bonus token drawn from p_k.
Greedy rows accept d_i exactly when it is the target's argmax, and emit the argmax at the
first mismatch: the same tokens as decoding one at a time.
"""

from __future__ import annotations

import torch

from quire.worker.draws import draw_rows, uniforms


def verify_greedy(target_argmax: list[int], proposals: list[int]) -> list[int]:
    """target_argmax: the argmax at each of the k+1 positions."""
    out = []
    for i, d in enumerate(proposals):
        out.append(target_argmax[i])
        if target_argmax[i] != d:
            return out
    out.append(target_argmax[len(proposals)])
    return out


def verify_sampled(probs: torch.Tensor, proposals: list[int],
                   generator: torch.Generator | None) -> list[int]:
    """probs: [k+1, vocab] target distributions, at any scale per row (as draw_rows takes
    them: min_p zeroes tokens without renormalising); acceptance reads p(d) as a probability,
    so each row is normalised first. Returns the accepted proposals, then one drawn token.
    Draws k uniforms and one token from `generator`, in order, so a seeded sequence repeats
    itself."""
    probs = probs / probs.sum(dim=-1, keepdim=True)
    k = len(proposals)
    ids = torch.tensor(proposals, dtype=torch.long, device=probs.device)
    p = probs[:k].gather(1, ids[:, None])[:, 0]
    u = torch.rand(k, generator=generator, device=probs.device, dtype=probs.dtype)
    accepted = (u < p).tolist()
    n = accepted.index(False) if False in accepted else k
    if n == k:
        return proposals + [_draw(probs[k], generator)]
    residual = probs[n].clone()
    residual[proposals[n]] = 0.0
    if not float(residual.sum()) > 0.0:  # p was a point mass on the rejected token: u >= 1
        residual = probs[n]
    return proposals[:n] + [_draw(residual, generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(draw_rows(weights[None], uniforms(1, generator, weights.device))[0])
