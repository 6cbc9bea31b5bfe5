"""What one scheduler step hands to the executor and back to the scheduler's update: plain
data (ids, token ids, block tables, sampling columns), never a Request."""

from __future__ import annotations

from dataclasses import dataclass, field

from quire.step_batch import StepBatch


@dataclass
class SchedulerOutput:
    batch: StepBatch                       # what the executor runs (chunks may be empty)
    seq_ids: list[str] = field(default_factory=list)  # the scheduled sequences
    chunk_seq_ids: list[str] = field(default_factory=list)  # batch.chunks[i]'s sequence
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence in seq_ids
    row_seq_ids: list[str] = field(default_factory=list)  # sampling row -> its sequence
    forks: dict[str, list[str]] = field(default_factory=dict)  # parent id -> n>1 sibling ids
    # speculative decoding: sequence id -> the proposals verified this step
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step
    failed: list[tuple[str, str]] = field(default_factory=list)  # (client request id, why)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def empty(self) -> bool:
        """Nothing for the executor to run (the scheduler may still have failed some)."""
        b = self.batch
        return not b.chunks and not b.swap_out and not b.swap_in
