"""The pooling runner's step: the scheduler's batch, where a chunk that reaches its prompt's
end is pooled (its last position's final hidden state comes back under its sequence id) and
nothing samples."""

from __future__ import annotations

from dataclasses import replace

from quire.engine.scheduler_output import SchedulerOutput
from quire.sampling_batch import SamplingBatch


def make_pooling_step(out: SchedulerOutput) -> None:
    """In place: pool keys on the chunks that end their prompt, no sampling rows."""
    out.batch.chunks = [
        replace(c, num_samples=0,
                pool_key=rid if c.start + len(c.token_ids) == c.num_tokens else None)
        for c, rid in zip(out.batch.chunks, out.chunk_seq_ids)]
    out.batch.sampling = _no_rows()
    out.row_seq_ids = []


def _no_rows() -> SamplingBatch:
    return SamplingBatch(greedy=[], temperature=[], top_k=[], top_p=[], min_p=[], logprobs=[],
                         repetition_penalty=[], presence_penalty=[], frequency_penalty=[],
                         penalized=[], prompt_token_ids=[], output_token_ids=[],
                         banned_token_ids=[])
