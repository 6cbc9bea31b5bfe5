"""The scheduler's plan becomes a StepBatch (each sequence's chunk, decodes first, and a
SamplingBatch with each sampled row's settings), so the executor gets values, never requests.

No tensors are made here: the grammar masks come from the features (`masks`), and a seeded
row carries its seed and sequence id; the executor keeps the row's generator.
"""

from __future__ import annotations

from collections.abc import Callable

from quire.engine.prompt_logprobs import prompt_logprobs_ask
from quire.engine.request import Request
from quire.engine.step_plan import StepPlan
from quire.sampling_batch import SamplingBatch, has_penalty
from quire.step_batch import SequenceChunk, StepBatch


def build_step_batch(out: StepPlan, masks: Callable, has_grammar: Callable[[str], bool]
                     ) -> tuple[StepBatch, list[Request], list[str]]:
    """The step's batch, the sequence each sampling row belongs to (in row order; a
    sequence verifying k proposals has k + 1 rows), and each chunk's sequence id. `masks(rows, groups)`: the rows' grammar
    bitmask or None; `has_grammar(seq id)`: a grammar decides when its EOS may come."""
    counts = out.num_new_tokens
    # decodes (one query token) first, then sequences verifying proposals (the runner makes
    # each position a decode row): attention backends batch them; prefill chunks last
    verifying = {i for i, s in enumerate(out.requests) if out.spec_token_ids.get(s.request_id)}
    order = [i for i, n in enumerate(counts) if n == 1 and i not in verifying]
    order += sorted(verifying)
    order += [i for i, n in enumerate(counts) if n != 1 and i not in verifying]
    chunks: list[SequenceChunk] = []
    rows: list[Request] = []
    ahead: list[int] = []  # per row: proposals before its position (0 but in verification)
    groups: list[tuple[int, list[int]]] = []
    for i in order:
        seq, n = out.requests[i], counts[i]
        start = seq.num_computed_tokens
        proposals = out.spec_token_ids.get(seq.request_id)
        if proposals:  # its known token, then the proposals: a row per position
            groups.append((len(rows), list(proposals)))
            rows += [seq] * (1 + len(proposals))
            ahead += range(1 + len(proposals))
            chunks.append(SequenceChunk(
                token_ids=seq.token_ids[start:start + 1] + list(proposals), start=start,
                num_prompt_tokens=seq.num_prompt_tokens, num_tokens=seq.num_tokens,
                block_table=out.block_tables[i], num_samples=0, lora=seq.lora,
                num_verified=len(proposals), mrope=seq.mrope))
            continue
        samples = []
        if start + n == seq.num_tokens:  # reaches the last known token: sample the next
            samples = [seq, *out.forks.get(seq.request_id, ())]
        rows += samples
        ahead += [0] * len(samples)
        chunks.append(SequenceChunk(
            token_ids=seq.token_ids[start:start + n], start=start,
            num_prompt_tokens=seq.num_prompt_tokens, num_tokens=seq.num_tokens,
            block_table=out.block_tables[i], num_samples=len(samples), lora=seq.lora,
            prompt_logprobs=prompt_logprobs_ask(seq, start, n),
            images=[im for im in seq.images if im.overlap(start, start + n)],
            mrope=seq.mrope))
    sampling = build_sampling_batch(rows, masks, has_grammar, ahead, groups)
    return (StepBatch(out.swap_out, out.swap_in, out.block_copies, chunks, sampling,
                      out.lora_keys_in_use), rows,
            [out.requests[i].request_id for i in order])


def build_sampling_batch(rows: list[Request], masks: Callable,
                         has_grammar: Callable[[str], bool], ahead: list[int] | None = None,
                         groups: list[tuple[int, list[int]]] = ()) -> SamplingBatch:
    """`ahead[i]`: how many proposals come before row i's position (a verification row)."""
    ahead = ahead or [0] * len(rows)
    params = [r.sampling_params for r in rows]
    penalized = [has_penalty(p) for p in params]
    # grammars are applied first in the sampler, so everything after sees only allowed tokens
    bitmask = masks(rows, list(groups)) if rows else None
    return SamplingBatch(
        greedy=[p.greedy for p in params],
        temperature=[p.temperature for p in params],
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        logprobs=[p.logprobs for p in params],
        repetition_penalty=[p.repetition_penalty for p in params],
        presence_penalty=[p.presence_penalty for p in params],
        frequency_penalty=[p.frequency_penalty for p in params],
        penalized=penalized,
        prompt_token_ids=[r.prompt_token_ids if pen else [] for r, pen in zip(rows, penalized)],
        output_token_ids=[r.output_token_ids if pen else [] for r, pen in zip(rows, penalized)],
        banned_token_ids=[_banned_token_ids(r, k, has_grammar) for r, k in zip(rows, ahead)],
        row_ids=[r.request_id for r in rows],
        # a seeded sequence's generator persists across steps (and preemptions) in the
        # executor, so a seed gives the same tokens whatever the batch
        seeds=[None if p.greedy else p.seed for p in params],
        bitmask=bitmask, spec_groups=list(groups))


def _banned_token_ids(seq: Request, ahead: int, has_grammar: Callable[[str], bool]
                      ) -> list[int]:
    """Under min_tokens, EOS and stop_token_ids can't be sampled (unless a grammar decides
    when EOS may come); `ahead` proposals count as outputs before a verification row."""
    if (seq.num_output_tokens + ahead >= seq.sampling_params.min_tokens
            or has_grammar(seq.request_id)):
        return []
    return list(seq.eos_token_ids | seq.stop_token_ids)
