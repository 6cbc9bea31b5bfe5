"""Prefill / extend attention: a chunk of new query tokens attends, causally, to everything
its sequence has cached, through the block table. The chunk's own K/V were written to the
cache first, so a whole prompt, a later chunk of it and a prompt whose prefix came from the
prefix cache all run the same loop over one key range.

One program serves a tile of a sequence's query tokens for one KV head: its BLOCK_M rows are
BLOCK_Q tokens x the GROUP query heads that share the KV head (row r = token r // GROUP,
head r % GROUP), so each K/V tile is loaded once for the whole group. The host lists the
(sequence, first query token) of every tile, so the grid has no idle programs.

Soft-capping caps each tile's scores before the mask; a row's sink starts its running max and
sum (max = the sink, sum = 1, no value). Key limits (base.py: an image's run that attends both
ways) replace each row's own position as the last key it sees, and stretch the tile's key
range to its rows' furthest limit; the window still counts back from the row's position.
"""

from __future__ import annotations

import triton
import triton.language as tl

from quire.attention.triton_kernels.common import LOG2E, kv_tile_offsets, load_kv_tile, softcap


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, tile_seq_ptr, tile_first_ptr, sinks_ptr, key_limits_ptr,
    qk_scale, v_scale, window, cap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LIMITS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_first_ptr + tile)      # first query token of the tile, in the chunk
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len                     # tokens before this chunk

    r = tl.arange(0, BLOCK_M)
    t = first + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_valid = (r < BLOCK_Q * GROUP) & (t < q_len)
    q_pos = cached + t
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    io_mask = row_valid[:, None] & d_valid[None, :]
    token = (q_start + t).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0).to(DOT_DTYPE)
    table_row = block_tables_ptr + seq * stride_bt

    # keys the tile's rows can see: up to its last query, from its first query's window
    hi = cached + tl.minimum(first + BLOCK_Q, q_len)
    last = q_pos
    if HAS_LIMITS:  # rows of an image's run see up to its end, inside this chunk
        last = tl.load(key_limits_ptr + token, mask=row_valid, other=0)
        hi = tl.maximum(hi, tl.max(last, 0) + 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(cached + first - window + 1, 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the row's sink: its logit starts the max, its exp2 the sum
        m = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        l = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile_start in range(lo, hi, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        rows = kv_tile_offsets(table_row, pos, valid, kv_head, stride_cache_block,
                               stride_cache_token, stride_cache_head, BLOCK_SIZE)
        k = load_kv_tile(k_cache_ptr, rows, valid, d, d_valid, DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFTCAP:
            s = softcap(s, cap)
        visible = pos[None, :] <= last[:, None]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # a row may see nothing in this tile (causal edge, window start): keep exp2 finite
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = load_kv_tile(v_cache_ptr, rows, valid, d, d_valid, DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new

    o = acc / tl.where(l == 0.0, 1.0, l)[:, None] * v_scale   # l == 0 only on padding rows
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_tiles(query_start_loc: list[int], first_seq: int, block_q: int):
    """(sequence, first query token) of every query tile of sequences first_seq and on."""
    seqs, firsts = [], []
    for seq in range(first_seq, len(query_start_loc) - 1):
        for first in range(0, query_start_loc[seq + 1] - query_start_loc[seq], block_q):
            seqs.append(seq)
            firsts.append(first)
    return seqs, firsts


def paged_prefill_attention(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
                            tile_seq, tile_first, *, scale: float, k_scale: float,
                            v_scale: float, sliding_window: int | None, dot_dtype,
                            dot_precision: str | None, block_m: int, block_q: int, block_n: int,
                            block_d: int, softcap: float | None = None, sinks=None,
                            key_limits=None) -> None:
    """q/out [T, H, D]; caches [num_blocks, block_size, Hkv, D]; tile_seq/tile_first from
    prefill_tiles() for the same block_q; sinks None or [H] float32 on q's device;
    key_limits None or [T] int32 (base.py)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    _prefill_kernel[(tile_seq.numel(), num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, tile_seq, tile_first,
        q if sinks is None else sinks, seq_lens if key_limits is None else key_limits,
        scale * k_scale * LOG2E, float(v_scale), sliding_window or 0, (softcap or 1.0) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        HAS_LIMITS=key_limits is not None,
    )
