"""Reference paged attention in plain torch, fast on CPU.

Decodes run the native CPU kernel (native/paged_decode.cpp), which reads K/V in place
through the block table, when it could be built and the cache holds the compute dtype.
Otherwise, and for prefill chunks, K/V are gathered a whole block at a time (one index_select of block-sized rows per layer,
~3x cheaper than per-token rows) and attended with scaled_dot_product_attention on strided
views (no layout copies). Decodes are batched, grouped by length so short contexts don't pay
for long ones. Prefill chunks that extend a cached prefix run together in one native call
(paged_extend.py); fresh prefill chunks loop per sequence (few per step). On an AMX CPU a
bfloat16 chunk whose mask is causal alone (16 rows or more over a cached prefix) goes to the
native tile kernel instead (native/prefill_attention.py: ~2x SDPA at 512 tokens,
benchmarks/prefill_attention.py). Index and mask tensors are built once per step and reused
by every layer. A chunk whose rows look ahead
(base.py's key_limits: an image's run, Gemma 3) takes the per-sequence path with its mask
built from the limits; the native kernels know only the causal mask.

SDPA has neither soft-capping nor sinks: with either, the native kernels take every decode and
prefill chunk they serve (q's dtype and the cache's), and the rest runs an explicit float32
matmul + softmax in transformers' eager order (the greedy-parity reference).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from quire.attention import paged_extend
from quire.attention.base import AttentionBackend, AttentionMetadata
from quire.native import paged_attention, prefill_attention

# Decodes whose padded length would waste more than this fraction go to a separate group.
_MAX_PADDING_WASTE = 0.25
# Half-precision prefill pads a chunk to a multiple of this many rows: torch's CPU flash kernel
# builds a matmul kernel per new shape, which costs more than the attention when every prompt
# has its own length. Zero rows at the end are invisible to the real rows under the causal
# mask. float32 keeps the exact shapes (and so the exact sums) that transformers uses.
_PREFILL_PAD = 64
# The eager path materializes [heads, query rows, keys] float32 scores: at most about this
# many elements at a time (256 MiB), taking query rows in slices.
_EAGER_MAX_SCORES = 1 << 26


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    hk, d = k_cache.shape[-2:]
    if k_cache.dtype != k.dtype:  # fp8: store value / scale, saturated (e4m3fn has no inf)
        limit = torch.finfo(k_cache.dtype).max
        k = (k.float() / k_scale).clamp_(-limit, limit).to(k_cache.dtype)
        v = (v.float() / v_scale).clamp_(-limit, limit).to(v_cache.dtype)
        # CPU torch has no index_copy_ for float8: move the bytes instead
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    k_cache.view(-1, hk, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, hk, d).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, scale: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """[n * nb] block ids -> [n, nb * block_size, Hkv, D] in the compute dtype."""
    num_blocks, bs, hk, d = cache.shape
    if cache.element_size() == 1:  # float8: gather the bytes (no CPU index_select for it)
        x = cache.view(torch.uint8).view(num_blocks, -1).index_select(0, block_ids)
        x = x.view(cache.dtype).to(dtype) * scale
    else:
        x = cache.view(num_blocks, -1).index_select(0, block_ids).to(dtype)
    return x.view(-1, bs, hk, d)


# Where the native kernel walks each query row alone (no tiles for this layout or build),
# chunks of at least this many new tokens over a cached prefix go to SDPA (gathered K/V, its
# blocked GEMM-like kernel): an 8,000-token prompt in 2,048-token chunks prefilled 8-13% faster
# that way on the AVX2 EPYC before its tiles were GEMM-shaped. The tiled kernel takes every
# chunk: 1.4-1.9x faster than SDPA there from 128 to 2,048 rows (benchmarks/HISTORY.md).
EXTEND_SDPA_MIN_ROWS = 256
# Where the AMX prefill kernel serves the layout, chunks of at least this many new tokens over a
# cached prefix go to it (gathered K/V) instead: against the row-walking kernel on the 2-core
# AMX Xeon (SmolLM2 heads, bfloat16; benchmarks/prefill_attention.py), 0.65 / 0.88 / 1.94 ms
# against 0.85 / 3.16 / 12.1 ms for 16 / 64 / 256 rows over 2,048 tokens.
AMX_EXTEND_MIN_ROWS = 16


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # no CUDA graphs: its decode plan caches masks computed from one step's seq_lens (on a
    # GPU, replays attended stale lengths: found on an H100, tokens diverged after a few steps)
    supports_cuda_graphs = False

    def prepare(self, meta: AttentionMetadata) -> None:
        fresh, extends = [], []
        for i in range(meta.num_decodes, meta.num_seqs):
            q0, q1 = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            (extends if meta.seq_lens_cpu[i] > q1 - q0 else fresh).append(i)  # cached prefix?
        meta.backend_state[self, "fresh"] = fresh
        meta.backend_state[self, "extends"] = extends
        meta.backend_state[self, "ahead"] = _chunks_looking_ahead(meta)

    def _prefill(self, q, k_cache, v_cache, out, meta, sinks, eager: bool) -> list:
        """Prefill chunks. Where the native kernel tiles this layout and the AMX prefill kernel
        does not serve it, all of them (fresh prompts and chunks over a cached prefix) run in
        one native call: it beats SDPA on both (in bfloat16 on a CPU with a bfloat16 dot
        product, the chunks shorter than paged_extend.sdpa_min_rows). Else the short
        chunks over a cached prefix run natively where the kernel serves q's dtype
        and the cache's (shorter than AMX_EXTEND_MIN_ROWS where the AMX prefill kernel takes
        the rest, else than EXTEND_SDPA_MIN_ROWS). With soft-capping or sinks (`eager`: SDPA
        can't) the kernel takes all it serves. What is left gets per-sequence plans, returned
        to run. The split is made once per step, at its first layer."""
        split = meta.backend_state.get((self, "prefill_split", eager))
        if split is None:
            fresh, extends = meta.backend_state[self, "fresh"], meta.backend_state[self, "extends"]
            ahead = meta.backend_state[self, "ahead"]
            rows = meta.query_start_loc_cpu
            kernel = bool(fresh or extends) and paged_extend.supported(q, k_cache)
            amx = (not eager and self._plain_causal(None)
                   and prefill_attention.serves(q, k_cache.shape[2]))
            if kernel and not amx and (eager or paged_extend.tiled(q, k_cache)):
                most = None if eager else paged_extend.sdpa_min_rows(q)
                native = sorted(i for i in fresh + extends if i not in ahead
                                and (most is None or rows[i + 1] - rows[i] < most))
                fresh = [i for i in fresh if i not in native]
                extends = [i for i in extends if i not in native]
            else:
                most = AMX_EXTEND_MIN_ROWS if amx else EXTEND_SDPA_MIN_ROWS
                native = [i for i in extends if kernel and i not in ahead
                          and rows[i + 1] - rows[i] < most]
                extends = [i for i in extends if i not in native]
            split = meta.backend_state[self, "prefill_split", eager] = (
                paged_extend.extend_rows(meta, native) if native else None,
                [self._fresh_plan(meta, i) for i in fresh]
                + [self._extend_plan(meta, i) for i in extends])
        index, plan = split
        if index is not None:
            paged_extend.paged_extend(q, k_cache, v_cache, out, meta.block_tables, *index,
                                      self.scale, self.sliding_window, self.logit_softcap, sinks)
        return plan

    def _fresh_plan(self, meta: AttentionMetadata, i: int) -> tuple:
        q0, q1 = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        limits = meta.backend_state[self, "ahead"].get(i)
        return q0, q1, q1 - q0, None, self._prefill_mask(q1 - q0, q1 - q0,
                                                         meta.block_tables.device, limits), \
            self._plain_causal(limits)

    def _extend_plan(self, meta: AttentionMetadata, i: int) -> tuple:
        q0, q1, ctx = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1], \
            meta.seq_lens_cpu[i]
        blocks = meta.block_tables[i, : -(-ctx // meta.block_size)].long()
        limits = meta.backend_state[self, "ahead"].get(i)
        return q0, q1, ctx, blocks, self._prefill_mask(ctx, q1 - q0, meta.block_tables.device,
                                                       limits), self._plain_causal(limits)

    def _plain_causal(self, limits) -> bool:
        """Whether a chunk's mask is causal alone (each row sees every key up to its own
        position): what the AMX prefill kernel does (no window, no look-ahead, no soft-capping;
        the caller checks for sinks)."""
        return limits is None and self.sliding_window is None and self.logit_softcap is None

    def _decode_groups(self, meta: AttentionMetadata) -> list:
        """The pure-torch decode plan: built on first use in a step, shared by the layers."""
        groups = meta.backend_state.get((self, "decode_groups"))
        if groups is not None:
            return groups
        lens = meta.seq_lens_cpu[: meta.num_decodes]
        order = sorted(range(len(lens)), key=lens.__getitem__)
        groups, start, used = [], 0, 0
        for j, seq in enumerate(order):  # shortest first; cut when padding would waste too much
            if j > start and used + lens[seq] < (1 - _MAX_PADDING_WASTE) * lens[seq] * (j - start + 1):
                groups.append(self._decode_group(meta, order[start:j], lens))
                start, used = j, 0
            used += lens[seq]
        if order:
            groups.append(self._decode_group(meta, order[start:], lens))
        meta.backend_state[self, "decode_groups"] = groups
        return groups

    def _decode_group(self, meta: AttentionMetadata, seqs: list[int], lens: list[int]):
        device = meta.block_tables.device
        rows = torch.tensor(seqs, device=device)
        num_blocks = -(-lens[seqs[-1]] // meta.block_size)
        pos = torch.arange(num_blocks * meta.block_size, device=device)
        seq_lens = meta.seq_lens[rows].long()
        mask = pos[None, :] < seq_lens[:, None]
        if self.sliding_window is not None:
            mask &= pos[None, :] >= seq_lens[:, None] - self.sliding_window
        blocks = meta.block_tables[rows, :num_blocks].long().reshape(-1)
        contiguous = seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        where = slice(seqs[0], seqs[0] + len(seqs)) if contiguous else rows
        return where, blocks, mask[:, None, None, :]

    def _prefill_mask(self, ctx: int, q_len: int, device, limits: torch.Tensor | None = None
                      ) -> torch.Tensor | None:
        """True = attended. `limits`: the chunk's key limits where some row looks ahead."""
        if ctx == q_len and self.sliding_window is None and limits is None:
            return None  # plain causal
        qpos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
        kpos = torch.arange(ctx, device=device)[None, :]
        mask = kpos <= (qpos if limits is None else limits.to(device).long()[:, None])
        if self.sliding_window is not None:  # counted back from the row's own position
            mask &= kpos > qpos - self.sliding_window
        return mask

    def forward(self, q, k, v, k_cache, v_cache, meta, k_scale=1.0, v_scale=1.0, sinks=None):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(q)
        gqa = self.num_heads != self.num_kv_heads
        eager = self.logit_softcap is not None or sinks is not None  # what SDPA can't do
        attend = functools.partial(self._eager, sinks=sinks) if eager else functools.partial(
            F.scaled_dot_product_attention, scale=self.scale, enable_gqa=gqa)
        nd = meta.num_decodes
        if nd and paged_attention.native_decode_supported(q, k_cache):
            paged_attention.paged_decode(q[:nd], k_cache, v_cache, out[:nd], meta.block_tables[:nd],
                                     meta.seq_lens[:nd], self.scale, self.sliding_window,
                                     self.logit_softcap, sinks)
            nd = 0
        for where, blocks, mask in (self._decode_groups(meta) if nd else ()):
            kc = gather_blocks(k_cache, blocks, k_scale, q.dtype)
            vc = gather_blocks(v_cache, blocks, v_scale, q.dtype)
            n = mask.shape[0]
            o = attend(q[where].view(n, self.num_heads, 1, self.head_dim),
                       kc.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2),
                       vc.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2),
                       attn_mask=mask)
            out[where] = o.view(n, self.num_heads, self.head_dim)
        pad = q.dtype != torch.float32 and not eager
        for q0, q1, ctx, blocks, mask, causal in self._prefill(q, k_cache, v_cache, out, meta,
                                                               sinks, eager):
            qc = q[q0:q1]
            if blocks is None:  # no cached prefix: this chunk's own K/V
                kc, vc = k[q0:q1], v[q0:q1]
            else:
                kc = gather_blocks(k_cache, blocks, k_scale, q.dtype).view(-1, *k.shape[1:])[:ctx]
                vc = gather_blocks(v_cache, blocks, v_scale, q.dtype).view(-1, *v.shape[1:])[:ctx]
            if causal and sinks is None and prefill_attention.supported(qc, kc, vc):
                # bfloat16 on AMX: ~2x SDPA at 512 tokens (benchmarks/prefill_attention.py)
                prefill_attention.causal(qc, kc, vc, out[q0:q1], self.scale)
                continue
            # (a sliding window's mask has the chunk's exact shape: no padding then)
            if blocks is None and pad and mask is None and (q1 - q0) % _PREFILL_PAD:
                qc, kc, vc = (_pad_rows(t, _PREFILL_PAD) for t in (qc, kc, vc))
            # 4-D (a batch of one): with 3-D inputs SDPA takes its slow math path on CPU
            o = attend(qc.transpose(0, 1)[None], kc.transpose(0, 1)[None],
                       vc.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None)
            out[q0:q1] = o[0, :, : q1 - q0].transpose(0, 1)
        return out

    def _eager(self, q, k, v, attn_mask=None, is_causal=False, sinks=None):
        """SDPA's arguments (q [n, H, Lq, D], k/v [n, Hkv, Lk, D], a boolean mask, True =
        attended, or causal) in float32, in transformers' eager order: scores times the scale,
        soft-capping, the mask, softmax with the sinks' column, then P @ V."""
        group = self.num_heads // self.num_kv_heads
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        n, heads, rows, _ = q.shape
        if is_causal:  # (only fresh chunks: Lq == Lk)
            attn_mask = torch.ones(rows, rows, dtype=torch.bool, device=q.device).tril_()
        if sinks is not None:
            sinks = sinks.float().view(1, heads, 1, 1)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        step = max(1, _EAGER_MAX_SCORES // (n * heads * k.shape[2]))
        for r0 in range(0, rows, step):
            scores = torch.matmul(q[:, :, r0:r0 + step].float(), k.transpose(2, 3)) * self.scale
            if self.logit_softcap is not None:
                scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
            mask = attn_mask if attn_mask is None or attn_mask.shape[-2] == 1 \
                else attn_mask[..., r0:r0 + step, :]
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            if sinks is None:
                probs = torch.softmax(scores, dim=-1)
            else:  # the sink's column joins the softmax, then is dropped: it adds no value
                scores = torch.cat([scores, sinks.expand(n, -1, scores.shape[2], -1)], dim=-1)
                scores = scores - scores.amax(dim=-1, keepdim=True)
                probs = torch.softmax(scores, dim=-1)[..., :-1]
            out[:, :, r0:r0 + step] = torch.matmul(probs, v)
        return out


def _chunks_looking_ahead(meta: AttentionMetadata) -> dict[int, torch.Tensor]:
    """Prefill sequence -> its chunk's key limits, for the chunks where some row may see a key
    past its own position (an image's run); empty without key_limits."""
    if meta.key_limits is None:
        return {}
    limits = meta.key_limits.cpu()
    ahead = {}
    for i in range(meta.num_decodes, meta.num_seqs):
        q0, q1 = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        pos = torch.arange(meta.seq_lens_cpu[i] - (q1 - q0), meta.seq_lens_cpu[i])
        if bool((limits[q0:q1] > pos).any()):
            ahead[i] = limits[q0:q1]
    return ahead


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    padded = x.new_zeros(-(-x.shape[0] // multiple) * multiple, *x.shape[1:])
    padded[: x.shape[0]] = x
    return padded
