"""Rotary position embeddings with the scaling forms Llama-family configs declare.

The formulas follow transformers' `modeling_rope_utils` operation for operation, because greedy
parity with it is the correctness oracle: the cos/sin tables must match bit for bit.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position (dynamic NTK computes per token)."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None,
                 max_position_embeddings: int, max_model_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        p = dict(rope_scaling or {})
        self.rope_type = p.get("rope_type", p.get("type", "default")) or "default"
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope scaling type {self.rope_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        self.head_dim, self.base, self.params = head_dim, rope_theta, p
        self.max_position_embeddings = max_position_embeddings
        self.dtype, self.device = dtype, device
        inv_freq = _base_inv_freq(rope_theta, head_dim)
        if self.rope_type == "linear":
            inv_freq = inv_freq / p["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, p)
        self.inv_freq = inv_freq
        if self.rope_type != "dynamic":
            positions = torch.arange(max_model_len, dtype=torch.int64)
            self.cos_table, self.sin_table = self._cos_sin(positions, inv_freq[None, :])

    def _cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor):
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.device, self.dtype), emb.sin().to(self.device, self.dtype)

    def cos_sin(self, positions: torch.Tensor, rope_seq_lens: torch.Tensor | None = None):
        """positions [T] (on the device). `rope_seq_lens` [T] (CPU) is, per token, the sequence
        length transformers' dynamic NTK would see when it computes that token."""
        if self.rope_type != "dynamic":
            return self.cos_table[positions], self.sin_table[positions]
        return self._dynamic_cos_sin(positions.cpu(), rope_seq_lens)

    def _dynamic_cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor):
        factor, dim, max_pos = self.params["factor"], self.head_dim, self.max_position_embeddings
        inv_freq = torch.empty(len(positions), dim // 2)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        for seq_len in seq_lens.unique().tolist():  # few distinct lengths per step
            if seq_len <= max_pos:
                inv_freq[seq_lens == seq_len] = self.inv_freq
                continue
            # float32 tensor arithmetic, as transformers does it when the sequence grows
            s = torch.tensor(seq_len, dtype=torch.int64)
            base = self.base * ((factor * s / max_pos) - (factor - 1)) ** (dim / (dim - 2))
            inv_freq[seq_lens == seq_len] = 1.0 / (base ** exponents)
        return self._cos_sin(positions, inv_freq)
