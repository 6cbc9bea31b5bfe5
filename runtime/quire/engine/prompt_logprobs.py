"""Prompt logprobs on the engine's side: which positions of a prompt chunk are scored (the
worker scores them from the chunk's own logits), and the scores back into vLLM's shape: per
prompt token a dict of token id -> Logprob (the top-k plus the token itself), the first
position None (nothing predicts it).

A request that asks for them skips the prefix cache's hits (as vLLM does): every prompt
position's logits must be computed, so a hit's tokens are recomputed (kv_cache_manager.py).
"""

from __future__ import annotations

from quire.engine.request import Request
from quire.outputs import Logprob
from quire.step_batch import PromptLogprobsAsk, PromptLogprobsResult

# One dict per prompt token (None for the first): token id -> Logprob.
PromptLogprobs = list[dict[int, Logprob] | None]


def wants_prompt_logprobs(seq: Request) -> bool:
    return seq.sampling_params.prompt_logprobs is not None


def prompt_logprobs_ask(seq: Request, start: int, n: int) -> PromptLogprobsAsk | None:
    """The ask for a chunk of `n` tokens from `start`: position p predicts prompt token p + 1,
    up to the prompt's last. None when nothing is asked: no prompt_logprobs, a sibling that
    did not compute the prompt, or a recompute after the first output (they are known)."""
    k = seq.sampling_params.prompt_logprobs
    if k is None or seq.sample_index or seq.num_output_tokens:
        return None
    last = min(start + n, seq.num_prompt_tokens - 1)
    if last <= start:
        return None
    return PromptLogprobsAsk(seq.request_id, k, seq.token_ids[start + 1:last + 1])


def fill_prompt_logprobs(into: PromptLogprobs, prompt_token_ids: list[int],
                         result: PromptLogprobsResult, decode) -> None:
    """Place one chunk's scores at their prompt positions (a recomputed chunk overwrites
    its own, equal, entries). `decode(token_id)`: the token's text."""
    for j, (lp, rank, ids, lps) in enumerate(zip(result.logprobs, result.ranks,
                                                   result.top_ids, result.top_logprobs)):
        pos = result.start + j + 1
        entry = {tid: Logprob(v, r + 1, decode(tid)) for r, (tid, v) in enumerate(zip(ids, lps))}
        token = prompt_token_ids[pos]
        if token not in entry:
            entry[token] = Logprob(lp, rank, decode(token))
        into[pos] = entry
