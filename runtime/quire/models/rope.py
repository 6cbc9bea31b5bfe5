"""Rotary position embeddings with the scaling forms Llama-family configs declare.

The formulas follow transformers' `modeling_rope_utils` operation for operation, because greedy
parity with it is the correctness oracle: the cos/sin tables must match bit for bit.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "longrope", "yarn")
# types whose frequencies transformers computes from the whole config (its own functions are
# used for them, so the tables match bit for bit)
_FROM_TRANSFORMERS = ("longrope", "yarn")


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


def _transformers_inv_freq(hf_config, rope_type: str, layer_type: str | None, **kw):
    """(inv_freq, attention scaling) from transformers' own rope functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if hf_config is None:
        raise ValueError(f"rope scaling type {rope_type!r} needs the model's config")
    if layer_type is not None:
        kw["layer_type"] = layer_type
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kw)
    return inv_freq.float().cpu(), float(scaling)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position (dynamic NTK computes per token; LongRoPE
    keeps a short and a long table and picks per token). `rotary_dim` < head_dim rotates only
    the first dims of each head (partial rotary): the tables are that wide."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None,
                 max_position_embeddings: int, max_model_len: int, dtype: torch.dtype,
                 device: torch.device, rotary_dim: int | None = None, hf_config=None,
                 layer_type: str | None = None) -> None:
        p = dict(rope_scaling or {})
        self.rope_type = p.get("rope_type", p.get("type", "default")) or "default"
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope scaling type {self.rope_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        dim = rotary_dim or head_dim
        self.head_dim, self.rotary_dim, self.base, self.params = head_dim, dim, rope_theta, p
        self.max_position_embeddings = max_position_embeddings
        self.dtype, self.device = dtype, device
        self.attention_scaling = 1.0
        self.long_threshold = None  # LongRoPE: sequences longer than this use the long table
        inv_freq = _base_inv_freq(rope_theta, dim)
        if self.rope_type == "linear":
            inv_freq = inv_freq / p["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, p)
        elif self.rope_type in _FROM_TRANSFORMERS:
            inv_freq, self.attention_scaling = _transformers_inv_freq(
                hf_config, self.rope_type, layer_type)
        self.inv_freq = inv_freq
        if self.rope_type != "dynamic":
            positions = torch.arange(max_model_len, dtype=torch.int64)
            self.cos_table, self.sin_table = self._cos_sin(positions, inv_freq[None, :])
        if self.rope_type == "longrope":
            self.long_threshold = p.get("original_max_position_embeddings") or getattr(
                hf_config, "original_max_position_embeddings", max_position_embeddings)
            long_inv_freq, _ = _transformers_inv_freq(hf_config, "longrope", layer_type,
                                                      seq_len=self.long_threshold + 1)
            positions = torch.arange(max_model_len, dtype=torch.int64)
            self.long_cos, self.long_sin = self._cos_sin(positions, long_inv_freq[None, :])

    @property
    def needs_seq_lens(self) -> bool:
        """Whether a token's table depends on the length transformers would see (the runner
        then passes rope_seq_lens)."""
        return self.rope_type in ("dynamic", "longrope")

    def _cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor):
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)

    def cos_sin(self, positions: torch.Tensor, rope_seq_lens: torch.Tensor | None = None):
        """positions [T] (on the device). `rope_seq_lens` [T] (CPU) is, per token, the sequence
        length transformers' dynamic NTK (or LongRoPE's switch) would see when it computes
        that token."""
        if self.rope_type == "dynamic":
            return self._dynamic_cos_sin(positions.cpu(), rope_seq_lens)
        cos, sin = self.cos_table[positions], self.sin_table[positions]
        if self.long_threshold is not None and rope_seq_lens is not None:
            long = (rope_seq_lens > self.long_threshold).to(positions.device)
            if bool(long.any()):
                cos = torch.where(long[:, None], self.long_cos[positions], cos)
                sin = torch.where(long[:, None], self.long_sin[positions], sin)
        return cos, sin

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


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2.5-VL): positions [3, T] of (temporal, height, width); the rotary's
    frequencies come in `mrope_section` runs (summing to rotary_dim / 2), run i reading
    position row i % 3, as transformers' recomposition_frequencies lays them out. Positions
    [T] (every row equal: text, generated tokens) read the plain table, which is the same."""

    def __init__(self, *args, mrope_section: list[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        half = self.rotary_dim // 2
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to {half} (half "
                             "the rotary dimension)")
        self.mrope_section = list(mrope_section)
        row = torch.cat([torch.full((n,), i % 3, dtype=torch.int64)
                         for i, n in enumerate(mrope_section)])
        self._dim_rows = torch.cat([row, row]).to(self.device)  # each rotary dim's row

    def cos_sin(self, positions: torch.Tensor, rope_seq_lens: torch.Tensor | None = None):
        if positions.ndim == 1:
            return super().cos_sin(positions, rope_seq_lens)
        pick = self._dim_rows.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos_table[positions].gather(0, pick)[0]  # [3, T, D] -> [T, D]
        sin = self.sin_table[positions].gather(0, pick)[0]
        return cos, sin
