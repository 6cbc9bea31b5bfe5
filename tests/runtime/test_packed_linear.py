"""bf16 projections on CPU. A projection without bias runs the native kernel's own copy
(quant_kernels.DenseBf16Kernel: decode rows at one weight read, prefill chunks on the
library's AMX tiles, else through oneDNN where it has bf16 kernels, else the native expanded
tiles); one with a bias runs oneDNN-packed weights (the same numbers as F.linear, the same greedy tokens as a model that doesn't pack).
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
from quire.layers.linear import MergedColumnParallelLinear
from quire.native import fused_ops, loader, matrix_engine, packed_linear
from quire.native import quant_matmul as qm

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
        if qm.amx_ready():  # a prefill chunk on the library's tiles: a row's bits whatever
            # other prefill rows come with it
            assert torch.equal(y, qm.dequantized_linear(x, kernel.packed))
            assert torch.equal(y[:matrix_engine.MIN_ROWS], kernel(x[:matrix_engine.MIN_ROWS]))
        else:
            assert torch.equal(y, F.linear(x, weight))  # oneDNN's own numbers
    else:  # the native kernel: a row's bits whatever rows come with it
        assert torch.equal(y[:1], kernel(x[:1]))


@pytest.mark.parametrize("march", ["native", *loader.isa_builds()])
def test_a_bfloat16_weight_on_the_tiles_is_its_exact_products(march):
    """dequantized_linear of a pack_bf16 weight (an AMX build: the weight's pairs only
    interleaved in cache, no rounding): one-hot rows of x read the weight back bit for bit,
    random rows keep the float32 bound above, the gated MLP's SiLU in the epilogue is
    fused_ops.silu_and_mul of the plain product bit for bit; None elsewhere (the caller
    then unblocks the weight for oneDNN). 100 output rows: a padded last block; a gate|up of
    2 x 48 rows: a part past the 32 columns torch's silu vectorizes."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(100, 192, generator=gen).bfloat16()
    packed = qm.pack_bf16(weight, _march=march)
    x = (torch.randn(67, 192, generator=gen) * 8).bfloat16()
    y = qm.dequantized_linear(x, packed, march)
    if not qm.amx_ready(march):
        assert y is None
        return
    one_hot = torch.eye(192)[torch.arange(67) * 5 % 192].bfloat16()
    assert torch.equal(qm.dequantized_linear(one_hot, packed, march), one_hot @ weight.T)
    want = x.double() @ weight.double().T
    terms = x.double().abs() @ weight.double().abs().T
    bound = 192 * 2.0 ** -24 * terms * (1 + 2.0 ** -8) + 2.0 ** -8 * want.abs()
    assert ((y.double() - want).abs() <= bound).all()
    for m in (1, 17, 33):  # rows of a pass past M: zeros, their outputs dropped
        assert torch.equal(qm.dequantized_linear(x[:m], packed, march), y[:m])
    # decode and verification rows (bf16_linear, any M) take the same tiles in the same order:
    # a float model's row has one set of bits from one row to a prefill. x's +-2^24 at k = 100
    # and 1200 (weight columns of ones) cancel, so y shows what each order rounded away in
    # between (a float32 chain in k order parts from the tiles in every row)
    wide = torch.randn(100, 1536, generator=gen)
    wide[:, 100] = wide[:, 1200] = 1
    wide = qm.pack_bf16(wide.bfloat16(), _march=march)
    xw = torch.randn(67, 1536, generator=gen)
    xw[:, 100], xw[:, 1200] = 2.0 ** 24, -(2.0 ** 24)
    xw = xw.bfloat16()
    prefill = qm.dequantized_linear(xw, wide, march)
    for m in (1, 2, 3, 9, 16, 17, 33, 67):
        assert torch.equal(qm.bf16_linear(xw[:m], wide), prefill[:m]), m
        assert torch.equal(qm.bf16_linear(xw[-m:], wide), prefill[-m:]), m
    gate_up = qm.pack_bf16(torch.randn(96, 192, generator=gen).bfloat16(), _march=march)
    silu = fused_ops.bf16_silu_exp(48)
    fused = qm.dequantized_linear(x, gate_up, march, silu=silu)
    assert torch.equal(fused, fused_ops.silu_and_mul(qm.dequantized_linear(x, gate_up, march)))


def test_a_dense_gated_mlp_fuses_its_activation_on_a_prefill_only(monkeypatch):
    """MergedColumnParallelLinear.silu_and_mul over a bfloat16 float weight: a prefill
    chunk's rows ask the native kernel for the fused road (taken where the library's tiles
    run, the two steps' bits either way); decode rows never ask."""
    layer = MergedColumnParallelLinear(192, [48, 48], quant_config=None, prefix="mlp.gate_up")
    weight = torch.randn(96, 192, generator=torch.Generator().manual_seed(12)).bfloat16()
    layer.native_kernel = quant_kernels.dense_bf16_kernel(weight)
    layer.quant_method.apply = lambda lay, x, bias: lay.native_kernel(x)
    asked = []
    fused_road = quant_kernels.DenseBf16Kernel.silu_and_mul
    monkeypatch.setattr(quant_kernels.DenseBf16Kernel, "silu_and_mul",
                        lambda self, x: asked.append(len(x)) or fused_road(self, x))
    x = torch.randn(matrix_engine.MIN_ROWS + 6, 192).bfloat16()
    before = matrix_engine.calls
    got = layer.silu_and_mul(x)
    # one call on the matrix engine: the fused product, or the plain one of the two steps
    assert matrix_engine.calls == before + matrix_engine.onednn_bf16()
    assert torch.equal(got, fused_ops.silu_and_mul(layer.native_kernel(x)))
    assert asked == [len(x)]
    fused = qm.amx_ready() and fused_ops.bf16_exp16() is not None
    assert (layer.native_kernel.silu_and_mul(x) is not None) == fused
    few = x[:matrix_engine.MIN_ROWS - 1]
    assert layer.native_kernel.silu_and_mul(few) is None
    assert torch.equal(layer.silu_and_mul(few), fused_ops.silu_and_mul(layer.native_kernel(few)))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased q/k/v projections
def test_bf16_engine_projections_match_plain(family, tiny_models, monkeypatch):
    # 100 and 150 tokens: prefill steps of MIN_ROWS rows or more (the matrix engine's road)
    prompts = random_prompts(6, lengths=[1, 7, 17, 33, 100, 150], seed=3, vocab=1000)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = matrix_engine.calls
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
    assert (matrix_engine.calls > before) == matrix_engine.onednn_bf16()
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
