"""bf16 projections on CPU. A projection without bias runs the native kernel's own copy
(quant_kernels.DenseBf16Kernel: decode rows at one weight read, prefill chunks through oneDNN
where it has bf16 kernels, else the native expanded tiles); one with a bias runs oneDNN-packed
weights (the same numbers as F.linear, the same greedy tokens as a model that doesn't pack).
The plain copies are freed. Where oneDNN has no bf16 kernels (AVX2 only: bf16 would be
emulated), nothing is packed and F.linear serves biased projections: the tests check that
fallback instead.

The native kernel's bound: each row is one float32 chain over k of exact products (bf16 x bf16
is exact in float32), then one bf16 rounding of y:
    |y - y64| <= K 2^-24 sum_k |x_k w_k| (1 + 2^-8) + 2^-8 |y64|."""

import pytest
import torch
import torch.nn.functional as F

from quire import LLM, SamplingParams
from quire.layers import quant_kernels
from quire.native import matrix_engine, packed_linear

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


@pytest.mark.parametrize("rows", [1, 3, 9, matrix_engine.MIN_ROWS, 300])
def test_native_bf16_kernel_within_the_float32_bound(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(100, 192, generator=gen).bfloat16()  # 100: a padded last block
    x = torch.randn(rows, 192, generator=gen).bfloat16()
    kernel = quant_kernels.dense_bf16_kernel(weight)
    assert kernel is not None and torch.equal(kernel.dequantize(), weight.float())
    y = kernel(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 100)
    want = x.double() @ weight.double().T
    terms = x.double().abs() @ weight.double().abs().T
    bound = 192 * 2.0 ** -24 * terms * (1 + 2.0 ** -8) + 2.0 ** -8 * want.abs()
    assert ((y.double() - want).abs() <= bound).all()
    if rows >= matrix_engine.MIN_ROWS and matrix_engine.onednn_bf16():
        assert torch.equal(y, F.linear(x, weight))  # a prefill chunk: oneDNN's own numbers
    else:  # the native kernel: a row's bits whatever rows come with it
        assert torch.equal(y[:1], kernel(x[:1]))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased q/k/v projections
def test_bf16_engine_projections_match_plain(family, tiny_models, monkeypatch):
    prompts = random_prompts(6, seed=3, vocab=1000)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny_models[family], dtype="bfloat16")
    layer = llm.engine.executor.model.layers[0]
    projections = [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
    for p in projections:
        if p.bias is None:  # the native kernel's copy, the plain one freed
            assert isinstance(p.native_kernel, quant_kernels.DenseBf16Kernel)
            assert p.packed_weight is None and p.weight.numel() == 0
        elif packed_linear.supported(torch.zeros(1, dtype=torch.bfloat16)):
            assert p.native_kernel is None and p.packed_weight is not None
            assert p.weight.numel() == 0
        else:  # this CPU's oneDNN has no bf16 kernels: the plain weight serves
            assert p.packed_weight is None and p.weight.numel() > 0
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_no_blocks_in_use(llm)
    del llm

    monkeypatch.setattr(packed_linear, "pack", lambda weight: None)
    monkeypatch.setattr(quant_kernels, "dense_bf16_kernel", lambda weight: None)
    plain = LLM(tiny_models[family], dtype="bfloat16")
    first = plain.engine.executor.model.layers[0].qkv_proj
    assert first.packed_weight is None and first.native_kernel is None
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    if family == "qwen2" and layer.o_proj.native_kernel is None:
        assert got == want  # oneDNN-packed is F.linear bit for bit
    else:  # the native kernel sums in another order than F.linear: only near-ties may flip
        firsts = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
                  for g, w in zip(got, want)]
        assert all(f > 0 for f in firsts) and sum(firsts) / len(firsts) >= 6, firsts
