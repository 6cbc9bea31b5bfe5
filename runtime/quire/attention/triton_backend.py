"""Paged attention in Triton kernels, for CUDA (and Triton's CPU interpreter in tests).

Per layer: the cache-write kernel stores the new K/V into their slots; decodes (one query
token, first in the batch) run the split-context decode kernel; the other sequences run the
prefill / extend kernel over the same cache. prepare() plans the step once for every layer:
the prefill query tiles and the number of decode splits. Both kernels take soft-capping and
sinks (base.py) as compile-time switches, so a model without them runs the kernels it did;
so does the prefill kernel take key limits (an image's run that attends both ways: a decode
never looks ahead).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quire.attention.base import AttentionBackend, AttentionMetadata
from quire.attention.triton_kernels import common
from quire.attention.triton_kernels.cache_write import write_kv_cache
from quire.attention.triton_kernels.decode import choose_num_splits, paged_decode_attention
from quire.attention.triton_kernels.prefill import paged_prefill_attention, prefill_tiles

# Decode splits: none shorter than this many context tokens, and up to this many
# (sequence, KV head, split) programs per streaming multiprocessor.
DEFAULT_MIN_SPLIT_LEN = 256
PROGRAMS_PER_SM = 2

# Whether the kernels were defined for Triton's CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = common.is_interpreted(common.kv_tile_offsets)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class _StepPlan:
    num_splits: int              # decode context splits
    tile_seq: torch.Tensor       # [tiles] int32: prefill sequence of each query tile
    tile_first: torch.Tensor     # [tiles] int32: its first query token within the chunk


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True  # the plan is host-side sizes and the step's query tiles

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window, logit_softcap)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.group = num_heads // num_kv_heads
        self.block_d = common.padded_head_dim(head_dim)
        self.block_m, self.block_q = common.prefill_rows(self.group, self.block_d)
        # split policy; tests lower these to run the split + reduce path on short contexts
        self.min_split_len = DEFAULT_MIN_SPLIT_LEN
        self.target_decode_programs: int | None = None   # None: PROGRAMS_PER_SM x SMs

    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.block_tables.device
        if device.type != "cuda" and not INTERPRETED:
            raise RuntimeError("the triton attention backend runs on CUDA, or on the CPU only "
                               "if TRITON_INTERPRET=1 was set before its kernels were imported")
        longest = max(meta.seq_lens_cpu[: meta.num_decodes], default=0)
        if self.sliding_window is not None:
            longest = min(longest, self.sliding_window)
        target = self.target_decode_programs
        if target is None:
            target = PROGRAMS_PER_SM * (_sm_count(device) if device.type == "cuda" else 1)
        seqs, firsts = prefill_tiles(meta.query_start_loc_cpu, meta.num_decodes, self.block_q)
        meta.backend_state[self] = _StepPlan(
            num_splits=choose_num_splits(meta.num_decodes, self.num_kv_heads, longest, target,
                                         self.min_split_len),
            tile_seq=torch.tensor(seqs, dtype=torch.int32, device=device),
            tile_first=torch.tensor(firsts, dtype=torch.int32, device=device))

    def forward(self, q, k, v, k_cache, v_cache, meta, k_scale=1.0, v_scale=1.0, sinks=None):
        plan: _StepPlan = meta.backend_state[self]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if k_cache.dtype == q.dtype:   # as in the torch backend, scales only mean fp8
            k_scale = v_scale = 1.0
        out = torch.empty_like(q)
        dot_dtype, precision = common.dot_config(q.dtype)
        if sinks is not None:
            if sinks.shape != (self.num_heads,):
                raise ValueError(f"sinks must have shape ({self.num_heads},), "
                                 f"got {tuple(sinks.shape)}")
            sinks = sinks.to(torch.float32).contiguous()
        shared = dict(scale=self.scale, k_scale=k_scale, v_scale=v_scale,
                      sliding_window=self.sliding_window, dot_dtype=dot_dtype,
                      dot_precision=precision, block_d=self.block_d,
                      softcap=self.logit_softcap, sinks=sinks)
        if meta.num_decodes:
            paged_decode_attention(
                q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, num_seqs=meta.num_decodes, num_splits=plan.num_splits,
                block_n=common.decode_block_n(self.block_d), **shared)
        if plan.tile_seq.numel():
            paged_prefill_attention(
                q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, plan.tile_seq, plan.tile_first, block_m=self.block_m,
                block_q=self.block_q, block_n=common.prefill_block_n(self.block_d, dot_dtype),
                key_limits=meta.key_limits, **shared)
        return out
