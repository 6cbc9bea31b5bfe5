"""LoRABatch: the step's rows grouped by adapter slot, built once per step and read by every
linear layer (the segment layout of Punica / S-LoRA's SGMV).

The Triton kernels walk the segments. The torch path pays a fixed cost per op, which many
short segments (decodes spread over many adapters) would multiply, so it takes the short
segments (at most SHORT_SEGMENT rows) together through one padded bmm (`PaddedSegments`)
and gives each longer one (a prefill chunk) its own matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SHORT_SEGMENT = 16


@dataclass
class PaddedSegments:
    rows: torch.Tensor          # token rows of the short segments
    flat_pos: torch.Tensor      # each row's place in a [groups x pad] padded block
    groups: int
    pad: int
    slots: torch.Tensor | None  # each group's slot; None: group g is slot g (every slot)


@dataclass
class LoRABatch:
    perm: torch.Tensor                   # [n] token rows that have an adapter, grouped by slot
    segments: list[tuple[int, int, int]]  # (slot, start, end): perm[start:end] use that slot
    seg_starts: torch.Tensor             # [S + 1] int32, the segments' bounds (for kernels)
    seg_slots: torch.Tensor              # [S] int32
    max_segment: int                     # rows in the longest segment
    whole: bool                          # one adapter for every row, in order: no gather
    use_triton: bool
    padded: PaddedSegments | None = None         # torch path: the short segments ...
    long_segments: list[tuple[int, int, int]] | None = None  # ... the others (None: all)

    @property
    def num_rows(self) -> int:
        return len(self.perm)


def build_lora_batch(token_slots: np.ndarray, device: torch.device, use_triton: bool,
                     num_slots: int | None = None) -> LoRABatch | None:
    """token_slots: each token's slot, -1 for the base model. None when no row has one, so
    the linears skip LoRA entirely."""
    rows = np.flatnonzero(token_slots >= 0)
    if len(rows) == 0:
        return None
    perm = rows[np.argsort(token_slots[rows], kind="stable")]
    slots = token_slots[perm]
    starts = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]])
    bounds = np.r_[starts, len(perm)]
    segments = [(int(slots[s]), int(s), int(e)) for s, e in zip(bounds[:-1], bounds[1:])]
    batch = LoRABatch(
        perm=torch.from_numpy(perm.astype(np.int64)).to(device),
        segments=segments,
        seg_starts=torch.from_numpy(bounds.astype(np.int32)).to(device),
        seg_slots=torch.from_numpy(slots[starts].astype(np.int32)).to(device),
        max_segment=int(np.diff(bounds).max()),
        whole=len(segments) == 1 and len(rows) == len(token_slots),
        use_triton=use_triton,
    )
    if not use_triton and not batch.whole:
        _split_for_torch(batch, perm, device, num_slots or 1 + int(slots.max()))
    return batch


def _split_for_torch(batch: LoRABatch, perm: np.ndarray, device, num_slots: int) -> None:
    short = [s for s in batch.segments if s[2] - s[1] <= SHORT_SEGMENT]
    batch.long_segments = [s for s in batch.segments if s[2] - s[1] > SHORT_SEGMENT]
    if len(short) < 2:  # nothing to batch: plain matmuls
        batch.long_segments = batch.segments
        return
    pad = max(e - s for _, s, e in short)
    every_slot = 2 * len(short) >= num_slots  # index slots in place rather than copy them
    group = [slot if every_slot else g for g, (slot, _, _) in enumerate(short)]
    rows = np.concatenate([perm[s:e] for _, s, e in short])
    flat = np.concatenate([g * pad + np.arange(e - s) for g, (_, s, e) in zip(group, short)])
    batch.padded = PaddedSegments(
        rows=torch.from_numpy(rows.astype(np.int64)).to(device),
        flat_pos=torch.from_numpy(flat.astype(np.int64)).to(device),
        groups=num_slots if every_slot else len(short),
        pad=pad,
        slots=None if every_slot else torch.tensor([s for s, _, _ in short], device=device),
    )
