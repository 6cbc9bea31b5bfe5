"""The torch backend's half-precision prefill pads each chunk (see _PREFILL_PAD): the padding
must stay invisible, so every real row equals causal attention computed in float32. With
soft-capping or sinks, which SDPA can't do, its explicit float32 path follows transformers'
eager order."""

import pytest
import torch
import torch.nn.functional as F

from quire.attention import paged_extend
from quire.attention.base import AttentionMetadata
from quire.attention.torch_backend import TorchAttentionBackend
from quire.native import paged_attention

from attention_reference import OPTIONS, check, options


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_half_precision_prefill_matches_float32_attention(dtype):
    heads, kv_heads, head_dim, bs = 6, 2, 64, 16
    lens = [1, 33, 64, 100]  # under, at and over a multiple of the padding
    gen = torch.Generator().manual_seed(0)
    total = sum(lens)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    need = [-(-n // bs) for n in lens]
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    starts, slots, block = [0], [], 0
    for i, n in enumerate(lens):
        tables[i, : need[i]] = torch.arange(block, block + need[i])
        slots.append(block * bs + torch.arange(n))
        block += need[i]
        starts.append(starts[-1] + n)
    k_cache = torch.zeros(block, bs, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    meta = AttentionMetadata(
        num_decodes=0, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.cat(slots), max_query_len=max(lens), max_seq_len=max(lens),
        block_size=bs, query_start_loc_cpu=starts, seq_lens_cpu=lens)
    backend = TorchAttentionBackend(heads, kv_heads, head_dim, head_dim ** -0.5, None)
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta)

    for i in range(len(lens)):
        rows = slice(starts[i], starts[i + 1])
        want = F.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1), k[rows].float().transpose(0, 1),
            v[rows].float().transpose(0, 1), is_causal=True, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[rows].float(), want, atol=2e-2, rtol=2e-2)


def _mixed_step(dtype, heads=6, kv_heads=2, head_dim=32, bs=8,
                seqs=((1, 1), (17, 1), (40, 1), (70, 1), (30, 12), (9, 1), (45, 45), (20, 20))):
    """(context, new tokens) per sequence, the four decodes first (at and past block edges),
    then chunks over a cached prefix (one of a single token), fresh prompts longer and shorter
    than the window. Blocks scattered; the cache holds each sequence's earlier tokens."""
    gen = torch.Generator().manual_seed(5)
    need = [-(-ctx // bs) for ctx, _ in seqs]
    perm = torch.randperm(sum(need) + 2, generator=gen)
    k_cache = torch.randn(len(perm), bs, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(len(perm), bs, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    starts, slots, used = [0], [], 0
    for i, ((ctx, new), nb) in enumerate(zip(seqs, need)):
        tables[i, :nb] = perm[used: used + nb]
        used += nb
        pos = torch.arange(ctx - new, ctx)
        slots.append(tables[i, pos // bs].long() * bs + pos % bs)
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(starts[-1], kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(starts[-1], kv_heads, head_dim, generator=gen).to(dtype)
    lens = [ctx for ctx, _ in seqs]
    meta = AttentionMetadata(
        num_decodes=4,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.cat(slots), max_query_len=max(n for _, n in seqs),
        max_seq_len=max(lens), block_size=bs, query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 2e-3)])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_eager_path_with_soft_capping_and_sinks_matches_transformers_order(dtype, tol, option,
                                                                          monkeypatch):
    """Where the native kernels don't serve (a build without them, float16, a GPU), decodes
    (batched by length) and prefill chunks run the explicit float32 path."""
    monkeypatch.setattr(paged_attention, "native_decode_supported", lambda q, k_cache: False)
    monkeypatch.setattr(paged_extend, "supported", lambda q, k_cache: False)
    q, k, v, k_cache, v_cache, meta = _mixed_step(dtype)
    opts = options(option, 6)
    backend = TorchAttentionBackend(6, 2, 32, 32 ** -0.5, opts["window"], opts["softcap"])
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, sinks=opts["sinks"])
    assert len(backend._decode_groups(meta)) > 1  # decodes of several lengths, several groups
    check(out, q, k_cache, v_cache, meta, backend.scale, tol, **opts)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_native_path_with_soft_capping_and_sinks_matches_transformers_order(option):
    q, k, v, k_cache, v_cache, meta = _mixed_step(torch.float32)
    assert paged_attention.native_decode_supported(q, k_cache) and paged_extend.supported(q, k_cache)
    opts = options(option, 6)
    backend = TorchAttentionBackend(6, 2, 32, 32 ** -0.5, opts["window"], opts["softcap"])
    backend.prepare(meta)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, sinks=opts["sinks"])
    check(out, q, k_cache, v_cache, meta, backend.scale, 1e-5, **opts)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan")])
def test_logit_softcap_must_be_positive(cap):
    with pytest.raises(ValueError, match="logit_softcap must be > 0"):
        TorchAttentionBackend(6, 2, 32, 1.0, None, cap)
