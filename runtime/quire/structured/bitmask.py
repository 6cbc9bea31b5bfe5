"""Applying a batch's grammar masks to its logits in one op."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`bitmask` is int32 [rows, ceil(vocab / 32)], bit b of word w allowing token 32w + b
    (the layout every grammar library fills). Rows without a grammar are all ones. Disallowed
    tokens become -inf; returns a new tensor."""
    rows, vocab = logits.shape
    bits = _BITS.to(logits.device)
    allowed = (bitmask.to(logits.device)[:, :, None] >> bits) & 1  # [rows, words, 32]
    allowed = allowed.view(rows, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))
