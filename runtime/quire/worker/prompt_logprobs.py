"""Prompt logprobs from a prefill's own logits: for each asked position, the logprob and rank
of the prompt token that follows it, and the top-k, as the sampler reports a sampled token's
(rank 1 = the most likely; ties rank below the target, as there)."""

from __future__ import annotations

import torch

from quire.step_batch import PromptLogprobsAsk, PromptLogprobsResult

_ROWS_PER_SLICE = 256  # float32 log-softmax over [rows, vocab]: bounded, whatever the chunk


def score_prompt_positions(logits: torch.Tensor, starts: list[int],
                           asks: list[PromptLogprobsAsk]) -> list[PromptLogprobsResult]:
    """`logits`: the asks' rows, in order (len(ask.target_ids) rows each); `starts`: each
    ask's chunk's first position."""
    results = []
    row = 0
    for start, ask in zip(starts, asks):
        n = len(ask.target_ids)
        targets = torch.tensor(ask.target_ids, dtype=torch.long, device=logits.device)
        lps, ranks, top_ids, top_lps = [], [], [], []
        for lo in range(0, n, _ROWS_PER_SLICE):
            hi = min(n, lo + _ROWS_PER_SLICE)
            x = torch.log_softmax(logits[row + lo:row + hi].float(), dim=-1)
            chosen = x.gather(1, targets[lo:hi, None])
            lps += chosen[:, 0].tolist()
            ranks += ((x > chosen).sum(dim=-1) + 1).tolist()
            if ask.num_top:
                values, ids = x.topk(ask.num_top, dim=-1)
                top_ids += ids.tolist()
                top_lps += values.tolist()
            else:
                top_ids += [[] for _ in range(hi - lo)]
                top_lps += [[] for _ in range(hi - lo)]
        results.append(PromptLogprobsResult(ask.key, start, lps, ranks, top_ids, top_lps))
        row += n
    return results
