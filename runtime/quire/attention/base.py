"""The interface every attention backend implements, and the per-step batch description.

A batch is one flat, unpadded run of tokens: sequence i owns query tokens
[query_start_loc[i], query_start_loc[i+1]) and attends to its first seq_lens[i] tokens, whose
K/V live in the paged cache at the blocks block_tables[i]. Decodes (one query token) come first.

Attention options, in transformers' eager order: scores s = (q . k) * scale; soft-capping
(Gemma 2, the backend's logit_softcap) s = cap * tanh(s / cap); the causal and sliding-window
mask; softmax, where sinks (gpt-oss, per layer, so forward's `sinks`) add one learned logit
per query head to the denominator and no value.

Bidirectional image runs (Gemma 3): `key_limits`, when set, gives each query token the last
key position it may see (its own, or the last of its image's run, which the step holds);
the window still counts back from the token's own position. None (every text-only step and
family) is the plain causal mask, on the unchanged paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    num_decodes: int                 # sequences 0..num_decodes-1 have exactly one query token
    query_start_loc: torch.Tensor    # [B + 1] int32, on the device
    seq_lens: torch.Tensor           # [B] int32: context length incl. this step's tokens
    block_tables: torch.Tensor       # [B, max_blocks] int32 (unused entries are 0)
    slot_mapping: torch.Tensor       # [T] int64: where each new token's K/V is written
    max_query_len: int
    max_seq_len: int
    block_size: int
    # the same, as Python lists, for backends that loop over prefill sequences on the host
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # per-step tensors a backend derives once in prepare() and reuses in every layer; keyed
    # by the backend instance (a model may have one per sliding window)
    backend_state: dict = field(default_factory=dict)
    # [T] int32 on the device: the last key position each query token may attend to, where
    # some look ahead (multimodal/image_attention.py); None: causal
    key_limits: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend:
    """Stateless across layers: one instance serves every layer of a model."""

    name = "base"
    # A captured CUDA graph replays only device work: a backend whose plan holds tensors
    # derived from one step's values (masks, gathers built on first use) can't be replayed.
    supports_cuda_graphs = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0 (or None for none), got {logit_softcap}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the forward; may fill meta.backend_state."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D] (any KV dtype,
        fp8 stored as value / scale); sinks: None, or this layer's [H] float32 sink logits (on
        q's device). Writes k/v into their slots, returns [T, H, D]."""
        raise NotImplementedError
