"""Paged decode attention: one query token per sequence, K/V read in place through the block
table.

One program serves a (sequence, KV head, context split): it loads each K/V tile once for
every query head of its GQA group, the group padded to the 16 rows tl.dot needs on a GPU.
Long contexts are cut into splits so that a batch of few sequences still fills the GPU
(flash-decoding); each split leaves its normalised partial output and log-sum-exp, and a
reduction kernel merges them. With one split the first kernel writes the output directly.

Soft-capping caps each tile's scores before the mask; a sink starts split 0's running max and
sum (max = the sink, sum = 1, no value), so the splits' merge counts it once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quire.attention.triton_kernels.common import LOG2E, kv_tile_offsets, load_kv_tile, softcap

MAX_SPLITS = 16


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    qk_scale, v_scale, window, num_splits, cap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_bt,
    stride_part_seq, stride_part_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SINGLE_SPLIT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    lo = 0
    if HAS_WINDOW:  # the query sits at seq_len - 1 and sees `window` keys back to itself
        lo = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(seq_len - lo, num_splits)   # short sequences leave splits empty
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + h
    h_valid = h < GROUP
    d_valid = d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=h_valid[:, None] & d_valid[None, :], other=0.0).to(DOT_DTYPE)
    table_row = block_tables_ptr + seq * stride_bt

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)   # running max, log2 domain
    l = tl.zeros([BLOCK_H], tl.float32)                  # running sum of exp2
    if HAS_SINKS:  # split 0 counts the sink: max = the sink's logit, its exp2 summed
        sink = tl.load(sinks_ptr + head, mask=h_valid, other=0.0).to(tl.float32) * LOG2E
        m = tl.where(split == 0, sink, m)
        l = tl.where(split == 0, 1.0, l)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        valid = pos < end   # every tile holds at least one valid key, so m stays finite
        rows = kv_tile_offsets(table_row, pos, valid, kv_head, stride_cache_block,
                               stride_cache_token, stride_cache_head, BLOCK_SIZE)
        k = load_kv_tile(k_cache_ptr, rows, valid, d, d_valid, DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFTCAP:
            s = softcap(s, cap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = load_kv_tile(v_cache_ptr, rows, valid, d, d_valid, DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m = m_new

    mask = h_valid[:, None] & d_valid[None, :]
    if SINGLE_SPLIT:
        o = acc / l[:, None] * v_scale
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # an empty split (short sequence) leaves lse = -inf and weighs nothing
        l = tl.where(l == 0.0, 1.0, l)
        part = seq * stride_part_seq + head * stride_part_head + split
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], acc / l[:, None],
                 mask=mask)
        tl.store(part_lse_ptr + part, m + tl.log2(l), mask=h_valid)   # empty: -inf


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, v_scale, num_splits,
    stride_ot, stride_oh, stride_part_seq, stride_part_head,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = seq * stride_part_seq + head * stride_part_head + s
    lse = tl.load(part_lse_ptr + part, mask=s < num_splits, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))   # split 0 is never empty, so the max is finite
    parts = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :],
                    mask=(s < num_splits)[:, None], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0) * v_scale
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def paged_decode_attention(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
                           *, num_seqs: int, num_splits: int, scale: float, k_scale: float,
                           v_scale: float, sliding_window: int | None, dot_dtype,
                           dot_precision: str | None, block_n: int, block_d: int,
                           softcap: float | None = None, sinks=None) -> None:
    """Attention for sequences 0..num_seqs-1, each with its one query token at
    query_start_loc[i]; q/out [T, H, D], caches [num_blocks, block_size, Hkv, D]; sinks
    None or [H] float32 on q's device."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    single = num_splits == 1
    part_out = part_lse = out   # unused placeholders with one split
    if not single:
        part_out = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                               device=q.device)
    part_strides = dict(stride_part_seq=num_heads * num_splits, stride_part_head=num_splits)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc,
        q if sinks is None else sinks,
        scale * k_scale * LOG2E, float(v_scale), sliding_window or 0, num_splits,
        (softcap or 1.0) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        **part_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_DTYPE=dot_dtype, DOT_PRECISION=dot_precision,
        HAS_WINDOW=sliding_window is not None, SINGLE_SPLIT=single,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, query_start_loc, float(v_scale), num_splits,
            out.stride(0), out.stride(1), **part_strides,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )


def choose_num_splits(num_seqs: int, num_kv_heads: int, longest_context: int,
                      target_programs: int, min_split_len: int) -> int:
    """Enough (sequence, KV head, split) programs to fill the device, none shorter than
    min_split_len tokens of context."""
    if num_seqs == 0 or longest_context <= min_split_len:
        return 1
    wanted = triton.cdiv(target_programs, num_seqs * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(longest_context, min_split_len), MAX_SPLITS))
