"""What the sampler reads for one step: per-row values in logits order, no requests.

The engine builds it from its sequences (engine/batch_builder.py); the worker's sampler turns
the columns into tensors. Neutral ground: both sides import it, it imports neither.

Per-request state that must outlive a step (a seeded row's own torch generator) stays with the
executor, keyed by the row's sequence id: the scheduler sends the seed and the id, and the
executor puts the sequence's generator in `generators` before sampling. Rank 0 samples under
tensor parallelism, in the engine's process, so a generator is never pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from quire.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine's side holds these objects but never touches tensors
    import torch


@dataclass
class SamplingBatch:
    """Column i of every list is logits row i."""
    greedy: list[bool]
    temperature: list[float]
    top_k: list[int]                  # 0 or >= vocab: off
    top_p: list[float]
    min_p: list[float]
    logprobs: list[int | None]        # top logprobs to return (0: the sampled token's alone)
    repetition_penalty: list[float]
    presence_penalty: list[float]
    frequency_penalty: list[float]
    penalized: list[bool]             # any penalty on: the row carries its token history
    prompt_token_ids: list[list[int]]  # penalized rows' prompt ([] elsewhere)
    output_token_ids: list[list[int]]  # penalized rows' outputs so far ([] elsewhere)
    banned_token_ids: list[list[int]]  # under min_tokens: EOS and stop ids can't be sampled
    row_ids: list[str] = field(default_factory=list)  # the sequence each row samples for
    seeds: list[int | None] = field(default_factory=list)  # seeded, non-greedy rows' seeds
    # the row's own generator (seeded, not greedy; the executor fills these from its store):
    # it draws the same tokens whatever else shares the batch; None: the shared generator
    generators: list[torch.Generator | None] = field(default_factory=list)
    bitmask: torch.Tensor | None = None  # grammar masks, int32 [rows, words]; None: no grammar
    # speculative decoding: (first row, proposals) per sequence verifying proposals; its
    # 1 + len(proposals) consecutive rows are the target's positions from its known token on
    spec_groups: list[tuple[int, list[int]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.greedy)

    def subset(self, rows: list[int]) -> SamplingBatch:
        """These rows alone (no verification groups)."""
        columns = {f.name: [getattr(self, f.name)[i] for i in rows] for f in fields(self)
                   if f.name not in ("bitmask", "spec_groups")}
        bitmask = None if self.bitmask is None else self.bitmask[rows]
        return SamplingBatch(**columns, bitmask=bitmask)


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
