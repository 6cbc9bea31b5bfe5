"""The torch path of the batched LoRA delta against a per-row reference: the padded bmm of
short segments (slots indexed in place, or gathered), long segments on their own, and rows
of the base model left alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quire.lora.batch import SHORT_SEGMENT, build_lora_batch
from quire.lora.ops import add_lora_torch


def per_row_reference(y, x, a, b, token_slots):
    out = y.clone().double()
    for i, s in enumerate(token_slots):
        if s >= 0:
            out[i] += (x[i].double() @ a[s].double()) @ b[s].double()
    return out


@pytest.mark.parametrize("counts,num_slots", [
    ({0: 1, 1: 3, 2: 1, 3: 2, 4: 1, 5: 1, 6: 4, 7: 2}, 8),   # decodes over every slot
    ({2: 1, 5: 3}, 8),                                        # a few slots: gathered
    ({1: 40, 3: 2, 4: 1}, 6),                                 # a prefill chunk and decodes
    ({0: SHORT_SEGMENT + 1}, 2),                              # one long segment only
])
def test_torch_path_matches_per_row_reference(counts, num_slots):
    rng = np.random.default_rng(0)
    token_slots = np.concatenate([[s] * n for s, n in counts.items()] + [[-1] * 5])
    token_slots = token_slots[rng.permutation(len(token_slots))]
    gen = torch.Generator().manual_seed(1)
    t, k, w, n = len(token_slots), 48, 24, 40
    x, y = torch.randn(t, k, generator=gen), torch.randn(t, n, generator=gen)
    a = torch.randn(num_slots, k, w, generator=gen) * 0.2
    b = torch.randn(num_slots, w, n, generator=gen) * 0.2
    batch = build_lora_batch(token_slots, torch.device("cpu"), False, num_slots)
    got = add_lora_torch(y.clone(), x, a, b, batch)
    torch.testing.assert_close(got.double(), per_row_reference(y, x, a, b, token_slots),
                               atol=1e-5, rtol=1e-5)
    base = torch.from_numpy(token_slots < 0)
    assert torch.equal(got[base], y[base])
