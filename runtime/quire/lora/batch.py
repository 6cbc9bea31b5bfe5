"""LoRABatch: the step's rows grouped by adapter slot, built once per step and read by every
linear layer (the segment layout of Punica / S-LoRA's SGMV)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRABatch:
    perm: torch.Tensor                   # [n] token rows that have an adapter, grouped by slot
    segments: list[tuple[int, int, int]]  # (slot, start, end): perm[start:end] use that slot
    seg_starts: torch.Tensor             # [S + 1] int32, the segments' bounds (for kernels)
    seg_slots: torch.Tensor              # [S] int32
    max_segment: int                     # rows in the longest segment
    whole: bool                          # one adapter for every row, in order: no gather
    use_triton: bool

    @property
    def num_rows(self) -> int:
        return len(self.perm)


def build_lora_batch(token_slots: np.ndarray, device: torch.device,
                     use_triton: bool) -> LoRABatch | None:
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
    return LoRABatch(
        perm=torch.from_numpy(perm.astype(np.int64)).to(device),
        segments=segments,
        seg_starts=torch.from_numpy(bounds.astype(np.int32)).to(device),
        seg_slots=torch.from_numpy(slots[starts].astype(np.int32)).to(device),
        max_segment=int(np.diff(bounds).max()),
        whole=len(segments) == 1 and len(rows) == len(token_slots),
        use_triton=use_triton,
    )
