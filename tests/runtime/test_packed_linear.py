"""bf16 projections on CPU run on oneDNN-packed weights: the same numbers as F.linear, and
the same greedy tokens as a model that doesn't pack, with the plain copies freed. Where
oneDNN has no bf16 kernels for this CPU (AVX2 only: bf16 would be emulated), nothing is packed
and F.linear serves: the tests check that fallback instead."""

import pytest
import torch
import torch.nn.functional as F

from quire import LLM, SamplingParams
from quire.native import packed_linear

from runtime_helpers import assert_no_blocks_in_use, random_prompts


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("shape", [(96, 64), (320, 64), (64, 160)])
def test_packed_linear_equals_f_linear(rows, shape):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(*shape, generator=gen).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16()
    x = torch.randn(rows, shape[1], generator=gen).bfloat16()
    packed = packed_linear.pack(weight)
    if not packed_linear.supported(weight):
        assert not torch.ops.mkldnn._is_mkldnn_bf16_supported() and packed is None
        return
    assert packed is not None
    assert torch.equal(packed_linear.linear(x, packed, bias), F.linear(x, weight, bias))
    assert packed_linear.pack(weight.float()) is None  # float32 keeps F.linear


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased projections
def test_bf16_engine_with_packed_weights_matches_plain(family, tiny_models, monkeypatch):
    prompts = random_prompts(6, seed=3, vocab=1000)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    packed = LLM(tiny_models[family], dtype="bfloat16")
    layer = packed.engine.executor.model.layers[0]
    projections = [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
    if packed_linear.supported(torch.zeros(1, dtype=torch.bfloat16)):
        assert all(p.packed_weight is not None for p in projections)
        assert layer.qkv_proj.weight.numel() == 0  # the plain copy is freed
    else:  # this CPU's oneDNN has no bf16 kernels: the plain weights serve
        assert all(p.packed_weight is None and p.weight.numel() > 0 for p in projections)
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params, use_tqdm=False)]
    assert_no_blocks_in_use(packed)
    del packed

    monkeypatch.setattr(packed_linear, "pack", lambda weight: None)
    plain = LLM(tiny_models[family], dtype="bfloat16")
    assert plain.engine.executor.model.layers[0].qkv_proj.packed_weight is None
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
