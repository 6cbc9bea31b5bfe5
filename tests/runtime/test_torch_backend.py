"""The torch backend's half-precision prefill pads each chunk (see _PREFILL_PAD): the padding
must stay invisible, so every real row equals causal attention computed in float32."""

import pytest
import torch
import torch.nn.functional as F

from quire.attention.base import AttentionMetadata
from quire.attention.torch_backend import TorchAttentionBackend


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
