"""The pooling runner's step batch: each scheduled sequence's prompt chunk, one-token chunks
first (the attention backends batch them as decodes); a chunk that reaches its prompt's end is
pooled (its last position's final hidden state comes back). Nothing samples."""

from __future__ import annotations

from quire.engine.batch_builder import build_sampling_batch
from quire.engine.scheduler_output import SchedulerOutput
from quire.step_batch import SequenceChunk, StepBatch


def build_pooling_batch(out: SchedulerOutput) -> StepBatch:
    chunks = []
    for seq, n, table in zip(out.requests, out.num_new_tokens, out.block_tables):
        start = seq.num_computed_tokens
        done = start + n == seq.num_tokens
        chunks.append(SequenceChunk(
            token_ids=seq.token_ids[start:start + n], start=start,
            num_prompt_tokens=seq.num_prompt_tokens, num_tokens=seq.num_tokens,
            block_table=table, num_samples=0, pool_key=seq.request_id if done else None))
    chunks.sort(key=lambda c: len(c.token_ids) != 1)  # stable: one-token chunks first
    return StepBatch(out.swap_out, out.swap_in, out.block_copies, chunks,
                     build_sampling_batch([], lambda seed: None), out.lora_keys_in_use)
