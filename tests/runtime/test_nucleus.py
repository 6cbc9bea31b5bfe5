"""The sampler's top-k / top-p filter against transformers' own warpers (TopKLogitsWarper, then
TopPLogitsWarper), on rows peaked enough for the top NUCLEUS_CANDIDATES tokens to decide and
on flat ones whose nucleus reaches past them (sorted whole, as transformers does: the same
tokens even among ties)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from quire.worker import sampler as sampler_module
from quire.worker.sampler import NUCLEUS_CANDIDATES, Sampler

VOCAB = 4096


def _rows(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.25, 0.0])  # peaked ... flat (0: all equal)
    return torch.randn(len(scales), VOCAB, generator=g) * scales[:, None]


def _transformers(x: torch.Tensor, k: int, p: float) -> torch.Tensor:
    if k:
        x = TopKLogitsWarper(top_k=k)(None, x.clone())
    if p < 1.0:
        x = TopPLogitsWarper(top_p=p)(None, x.clone())
    return torch.isfinite(x)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999, 1.0])
@pytest.mark.parametrize("top_k", [0, 20, 600])
def test_the_kept_tokens_are_transformers_warpers(top_k, top_p):
    x = _rows(seed=int(top_p * 1000) + top_k)
    sampler = Sampler(VOCAB, torch.device("cpu"), 0)
    n = len(x)
    got = sampler._top_k_top_p(x, [top_k] * n, [top_p] * n)
    for i in range(n):
        want = _transformers(x[i:i + 1], top_k, top_p)[0]
        assert torch.equal(torch.isfinite(got[i]), want), (i, int(want.sum()))
        kept = torch.isfinite(got[i])
        assert torch.equal(got[i][kept], x[i][kept])  # kept logits pass through unchanged


def test_rows_with_other_settings_and_a_wide_nucleus_in_one_batch(monkeypatch):
    """Per-row settings in one call, a flat row taking the sorted path, and top_p = 1 rows left
    whole; with fewer candidates more rows take the wider passes and nothing changes."""
    x = _rows(seed=3)
    settings = [(0, 0.9), (40, 1.0), (0, 1.0), (5, 0.3), (0, 0.99), (0, 0.8)]
    ks, ps = [k for k, _ in settings], [p for _, p in settings]
    sampler = Sampler(VOCAB, torch.device("cpu"), 0)
    got = sampler._top_k_top_p(x, ks, ps)
    for i, (k, p) in enumerate(settings[:-1]):
        assert torch.equal(torch.isfinite(got[i]), _transformers(x[i:i + 1], k, p)[0]), i
    assert torch.isfinite(got[2]).all()
    assert int(torch.isfinite(got[5]).sum()) > NUCLEUS_CANDIDATES[0]  # the flat row: wide
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", (8, 64))
    assert torch.equal(torch.isfinite(sampler._top_k_top_p(x, ks, ps))[:5],
                       torch.isfinite(got)[:5])


def test_a_row_of_nan_or_with_banned_tokens_does_not_break_the_batch():
    x = _rows(seed=4)[:3].clone()
    x[0] = float("nan")
    x[1, :VOCAB - 3] = float("-inf")  # three tokens allowed
    got = Sampler(VOCAB, torch.device("cpu"), 0)._top_k_top_p(x, [0, 0, 0], [0.9, 0.9, 0.9])
    assert torch.isnan(got[0]).all()
    assert 1 <= int(torch.isfinite(got[1]).sum()) <= 3
    assert torch.equal(torch.isfinite(got[2]), _transformers(x[2:3], 0, 0.9)[0])
