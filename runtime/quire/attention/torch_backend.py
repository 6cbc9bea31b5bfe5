"""Reference paged attention in plain torch, fast on CPU.

Decodes are batched: once per step, each decode sequence's context slots are laid out in one
padded index (grouped by length, so short contexts don't pay for long ones), then every layer
gathers K/V with a single index_select and runs batched matmuls. Prefill chunks loop per
sequence (few per step) and use scaled_dot_product_attention over the gathered context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quire.attention.base import AttentionBackend, AttentionMetadata

# Decodes whose padded length would waste more than this fraction go to a separate group.
_MAX_PADDING_WASTE = 0.25


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    hk, d = k_cache.shape[-2:]
    if k_cache.dtype != k.dtype:  # fp8: store value / scale
        k, v = (k / k_scale).to(k_cache.dtype), (v / v_scale).to(v_cache.dtype)
    k_cache.view(-1, hk, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, hk, d).index_copy_(0, slot_mapping, v)


def context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of a sequence's first `length` tokens."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        bs = meta.block_size
        lens = meta.seq_lens_cpu[: meta.num_decodes]
        order = sorted(range(len(lens)), key=lens.__getitem__)
        groups, start, used = [], 0, 0
        for j, seq in enumerate(order):  # shortest first; cut when padding would waste too much
            if j > start and used + lens[seq] < (1 - _MAX_PADDING_WASTE) * lens[seq] * (j - start + 1):
                groups.append(self._decode_group(meta, order[start:j], lens, bs))
                start, used = j, 0
            used += lens[seq]
        if order:
            groups.append(self._decode_group(meta, order[start:], lens, bs))
        meta.backend_state["decode_groups"] = groups
        prefills = []
        for i in range(meta.num_decodes, meta.num_seqs):
            q0, q1 = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            ctx = meta.seq_lens_cpu[i]
            slots = context_slots(meta.block_tables[i], ctx, bs) if ctx > q1 - q0 else None
            prefills.append((q0, q1, ctx, slots))
        meta.backend_state["prefills"] = prefills

    def _decode_group(self, meta, seqs, lens, bs):
        device = meta.block_tables.device
        rows = torch.tensor(seqs, device=device)
        max_len = lens[seqs[-1]]
        pos = torch.arange(max_len, device=device)
        seq_lens = meta.seq_lens[rows].long()
        valid = pos[None, :] < seq_lens[:, None]
        if self.sliding_window is not None:
            valid &= pos[None, :] >= seq_lens[:, None] - self.sliding_window
        tables = meta.block_tables[rows].long()
        slots = tables.gather(1, (pos // bs).expand(len(seqs), -1)) * bs + pos % bs
        slots = torch.where(valid, slots, 0)
        bias = torch.zeros(valid.shape, device=device).masked_fill_(~valid, float("-inf"))
        return rows, slots.reshape(-1), bias[:, None, None, :], max_len

    def forward(self, q, k, v, k_cache, v_cache, meta, k_scale=1.0, v_scale=1.0):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(q)
        hk, d = k_cache.shape[-2:]
        k_flat, v_flat = k_cache.view(-1, hk, d), v_cache.view(-1, hk, d)
        for rows, slots, bias, max_len in meta.backend_state["decode_groups"]:
            out[rows] = self._decode(q[rows], k_flat, v_flat, slots, bias, max_len, k_scale, v_scale)
        for q0, q1, ctx, slots in meta.backend_state["prefills"]:
            if slots is None:  # no cached prefix: attend to this chunk's own K/V
                kc, vc = k[q0:q1], v[q0:q1]
            else:
                kc = self._load(k_flat, slots, k_scale, q.dtype)
                vc = self._load(v_flat, slots, v_scale, q.dtype)
            out[q0:q1] = self._prefill(q[q0:q1], kc, vc, ctx)
        return out

    @staticmethod
    def _load(cache_flat, slots, scale, dtype):
        x = cache_flat.index_select(0, slots)
        if x.dtype != dtype:
            x = x.to(dtype) * scale
        return x

    def _decode(self, q, k_flat, v_flat, slots, bias, max_len, k_scale, v_scale):
        n = q.shape[0]
        hk, d = self.num_kv_heads, self.head_dim
        g = self.num_heads // hk
        kc = self._load(k_flat, slots, k_scale, q.dtype).view(n, max_len, hk, d)
        vc = self._load(v_flat, slots, v_scale, q.dtype).view(n, max_len, hk, d)
        qg = q.view(n, hk, g, d)
        scores = torch.matmul(qg, kc.permute(0, 2, 3, 1)).float()   # [n, hk, g, L]
        scores = scores * self.scale + bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs, vc.transpose(1, 2))                  # [n, hk, g, d]
        return o.reshape(n, self.num_heads, d)

    def _prefill(self, q, kc, vc, ctx):
        ql = q.shape[0]
        mask = None
        causal = ctx == ql and self.sliding_window is None
        if not causal:
            qpos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = kpos <= qpos
            if self.sliding_window is not None:
                mask &= kpos > qpos - self.sliding_window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kc.transpose(0, 1)[None], vc.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return o[0].transpose(0, 1)
