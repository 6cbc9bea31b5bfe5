"""worker/draws.py: tokens drawn by inverse CDF, one uniform a row."""

from __future__ import annotations

import torch

from quire.worker import draws
from quire.worker.draws import draw_rows, uniforms


def test_draws_follow_the_distribution():
    """60,000 rows of one distribution with a zero in it: every frequency within 4.5 standard
    errors of its probability (a fixed seed: the same draws each run), the zero never drawn."""
    p = torch.tensor([0.5, 0.25, 0.0, 0.125, 0.1, 0.025])
    n = 60_000
    g = torch.Generator().manual_seed(1)
    got = draw_rows(p.repeat(n, 1), uniforms(n, g, torch.device("cpu")))
    freq = torch.bincount(got, minlength=len(p)).double() / n
    assert freq[2] == 0
    se = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((freq - p.double()).abs() <= 4.5 * se + 1e-12).all(), (freq, p)


def test_unnormalised_rows_and_scaled_ones_draw_alike():
    """A residual after a rejection is not renormalised: u times the row's total is the same
    point of its CDF either way."""
    p = torch.tensor([[0.2, 0.0, 0.3, 0.5]])
    for u in (0.0, 0.1999, 0.2, 0.49, 0.5, 0.9999):
        t = torch.tensor([u], dtype=torch.float64)
        assert int(draw_rows(p, t)[0]) == int(draw_rows(p * 7.0, t)[0])


def test_boundaries_never_land_on_a_token_without_mass():
    p = torch.tensor([[0.0, 0.0, 0.4, 0.0, 0.6, 0.0, 0.0]])
    cases = {0.0: 2, 0.3999: 2, 0.4: 4, 1 - 2 ** -53: 4}
    for u, want in cases.items():
        assert int(draw_rows(p, torch.tensor([u], dtype=torch.float64))[0]) == want, u


def test_a_rows_draw_is_the_same_alone_in_a_batch_and_in_chunks(monkeypatch):
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(37, 4096) * 3, dim=-1)
    u = torch.rand(37, dtype=torch.float64)
    whole = draw_rows(probs, u)
    alone = torch.stack([draw_rows(probs[i:i + 1], u[i:i + 1])[0] for i in range(37)])
    monkeypatch.setattr(draws, "_CHUNK_VALUES", 3 * 4096)  # three rows a float64 sum
    chunked = draw_rows(probs, u)
    assert torch.equal(whole, alone) and torch.equal(whole, chunked)
    assert draw_rows(probs[:0], u[:0]).shape == (0,)


def test_a_seeded_generator_gives_one_float64_uniform_a_row():
    a = uniforms(3, torch.Generator().manual_seed(5), torch.device("cpu"))
    b = torch.rand(3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert a.dtype == torch.float64 and torch.equal(a, b)
