"""The batched LoRA delta, y += (x @ A[slot]) @ B[slot] for each row with its own slot.

Rows are grouped by slot (`LoRABatch`), so the work is one shrink and one expand per segment
(at most max_loras of them), never a loop over requests. Base-model rows are in no segment and
cost nothing. The torch path below is the reference and the CPU path; CUDA runs the Triton
kernels of `triton_ops.py`, which read the same layout.
"""

from __future__ import annotations

import torch

from quire.lora.batch import LoRABatch


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             batch: LoRABatch) -> torch.Tensor:
    """lora_a: [slots, in, width], lora_b: [slots, width, out]; adds into y in place."""
    if batch.use_triton:
        from quire.lora.triton_ops import add_lora_triton
        return add_lora_triton(y, x, lora_a, lora_b, batch)
    return add_lora_torch(y, x, lora_a, lora_b, batch)


def add_lora_torch(y, x, lora_a, lora_b, batch: LoRABatch) -> torch.Tensor:
    if batch.whole:  # every row, one adapter: no gather or scatter
        slot = batch.segments[0][0]
        y += (x @ lora_a[slot]) @ lora_b[slot]
        return y
    p = batch.padded
    if p is not None:  # the short segments, padded to one length: two bmm for all of them
        a = lora_a if p.slots is None else lora_a.index_select(0, p.slots)
        b = lora_b if p.slots is None else lora_b.index_select(0, p.slots)
        xp = x.new_zeros(p.groups * p.pad, x.shape[1])
        xp.index_copy_(0, p.flat_pos, x.index_select(0, p.rows))
        d = torch.bmm(torch.bmm(xp.view(p.groups, p.pad, -1), a), b)
        y.index_add_(0, p.rows, d.view(p.groups * p.pad, -1).index_select(0, p.flat_pos))
    loop = batch.segments if batch.long_segments is None else batch.long_segments
    for slot, start, end in loop:
        rows = batch.perm[start:end]
        y.index_add_(0, rows, (x.index_select(0, rows) @ lora_a[slot]) @ lora_b[slot])
    return y
