"""Each rank's layer keeps exactly its shard of a checkpoint tensor (no processes needed:
layers are built as rank r of a group of n with `shard_as`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quire.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from quire.layers.vocab_parallel import ParallelLMHead
from quire.parallel_state import shard_as

D = 4  # head_dim


def _qkv(rank, size, heads, kv_heads, q, k, v):
    with shard_as(rank, size):
        layer = QKVParallelLinear(8, D, heads, kv_heads, bias=False)
    for part, w in (("q", q), ("k", k), ("v", v)):
        layer.weight_loader(layer.weight, w, part)
    return layer


@pytest.mark.parametrize("size,kv_heads", [(2, 2), (2, 1), (4, 2)])
def test_qkv_keeps_its_query_heads_and_the_kv_head_they_read(size, kv_heads):
    heads = 4
    q = torch.randn(heads * D, 8)
    k, v = torch.randn(kv_heads * D, 8), torch.randn(kv_heads * D, 8)
    for rank in range(size):
        layer = _qkv(rank, size, heads, kv_heads, q, k, v)
        hq = heads // size
        kv = rank * kv_heads // size if kv_heads < size else rank * (kv_heads // size)
        nkv = max(1, kv_heads // size)
        want = torch.cat([q[rank * hq * D:(rank + 1) * hq * D], k[kv * D:(kv + nkv) * D],
                          v[kv * D:(kv + nkv) * D]])
        assert torch.equal(layer.weight, want), rank
        # the KV head a rank holds is the one its query heads use under GQA
        group = heads // kv_heads
        assert all(h // group == kv for h in range(rank * hq, (rank + 1) * hq))


def test_mlp_shards_sum_to_the_whole_mlp():
    h, inter, size = 16, 32, 2
    torch.manual_seed(0)
    gate, up, down = torch.randn(inter, h), torch.randn(inter, h), torch.randn(h, inter)
    x = torch.randn(5, h)
    whole = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    total = torch.zeros_like(whole)
    for rank in range(size):
        with shard_as(rank, size):
            gate_up = MergedColumnParallelLinear(h, [inter, inter])
            down_proj = RowParallelLinear(inter, h)
        gate_up.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight_loader(gate_up.weight, up, 1)
        down_proj.weight_loader(down_proj.weight, down)
        g, u = F.linear(x, gate_up.weight).chunk(2, dim=-1)  # the rank's local matmuls
        total += F.linear(F.silu(g) * u, down_proj.weight)   # summed: the all-reduce
    # the same products summed in another order: fp32 rounding, nothing more
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-4)


def test_lm_head_pads_the_last_vocabulary_slice_with_zero_rows():
    vocab, h, size = 10, 4, 4
    w = torch.randn(vocab, h)
    shards = []
    for rank in range(size):
        with shard_as(rank, size):
            head = ParallelLMHead(vocab, h)
        head.weight_loader(head.weight, w)
        shards.append(head.weight.data)
    assert all(s.shape == (3, h) for s in shards)
    assert torch.equal(torch.cat(shards)[:vocab], w)
    assert not torch.cat(shards)[vocab:].any()


def test_a_lazy_safetensors_slice_loads_only_the_shard(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    down = torch.randn(16, 32)
    save_file({"down": down}, str(tmp_path / "w.safetensors"))
    with shard_as(1, 2):
        layer = RowParallelLinear(32, 16)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        layer.weight_loader(layer.weight, f.get_slice("down"))
    assert torch.equal(layer.weight, down[:, 16:])


def test_heads_that_do_not_divide_are_a_clear_error():
    with shard_as(0, 2), pytest.raises(ValueError, match="tensor_parallel_size.*9"):
        QKVParallelLinear(576, 64, 9, 3)
