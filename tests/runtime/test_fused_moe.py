"""The fused MoE layer: the grouped CPU path against the per-expert loop and against
transformers' own MoE blocks, its routers, quantized experts, loading and the Triton kernel
(in the interpreter, in a child process)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from moe_helpers import random_moe, routed

from quire.layers.fused_moe import routing
from quire.layers.quantization import QuantizeOnLoadConfig

from runtime_helpers import run_triton_interpreter_suite


def _outputs(layer, x, logits, impls=("loop", "grouped")):
    outs = {}
    for impl in impls:
        layer.impl = impl
        outs[impl] = layer(x, logits)
    return outs


@pytest.mark.parametrize("num_tokens", [1, 16, 256])
@pytest.mark.parametrize("family", ["silu", "swigluoai"])
def test_grouped_equals_the_per_expert_loop_in_float32(family, num_tokens):
    """Equal up to the float32 rounding of a matmul row, which depends on the row's place in
    its expert's matrix (the loop orders rows as transformers' eager loop, the grouped path
    as its grouped_mm path)."""
    layer, _ = random_moe(num_experts=8, top_k=2, bias=family == "swigluoai", activation=family)
    x, logits = routed(num_tokens, 8)
    outs = _outputs(layer, x, logits)
    torch.testing.assert_close(outs["grouped"], outs["loop"], rtol=1e-6, atol=2e-6)
    if num_tokens >= 16:  # several experts really chosen
        assert len(torch.unique(layer.router(logits)[1])) >= 6


def test_top4_sums_a_tokens_experts_in_top_k_order():
    """k > 2: the grouped path adds a token's rows in top-k order, as transformers' default
    experts do; the loop adds them in expert order. Both are float32 sums of the same terms."""
    layer, _ = random_moe(num_experts=8, top_k=4)
    x, logits = routed(64, 8)
    outs = _outputs(layer, x, logits)
    torch.testing.assert_close(outs["grouped"], outs["loop"], rtol=1e-6, atol=1e-6)


def test_bfloat16_grouped_is_close_to_the_loop():
    layer, _ = random_moe(num_experts=8, top_k=2, dtype=torch.bfloat16)
    x, logits = routed(48, 8, dtype=torch.bfloat16)
    outs = _outputs(layer, x, logits)
    assert outs["grouped"].dtype == torch.bfloat16
    torch.testing.assert_close(outs["grouped"].float(), outs["loop"].float(), rtol=2e-2,
                               atol=2e-2)


@pytest.mark.parametrize("kind,group", [("int8", None), ("int4", 32)])
def test_quantized_experts_keep_their_format_and_match_the_dequantized_loop(kind, group):
    layer, full = random_moe(num_experts=6, quant_config=QuantizeOnLoadConfig(kind, group))
    names = {n for n, _ in layer.named_parameters()}
    assert "w13_qweight" in names and "w13_weight" not in names
    assert layer.method.kind == kind
    x, logits = routed(40, 6)
    outs = _outputs(layer, x, logits)
    assert torch.equal(outs["grouped"], outs["loop"])
    # the quantized weights are close to the float ones they came from
    w13 = torch.cat([full["w1"], full["w3"]], dim=1)
    err = (layer.dense_weights("w13") - w13).abs().max().item()
    assert 0 < err < (0.01 if kind == "int8" else 0.1)


def _hf_block(family: str, layer, full, top_k: int, impl: str):
    """transformers' own MoE block with the same experts and a random router."""
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    e, inter, hidden = full["w1"].shape
    common = dict(hidden_size=hidden, num_experts_per_tok=top_k)
    if family == "mixtral":
        cfg = MixtralConfig(num_local_experts=e, intermediate_size=inter, **common)
        block = MixtralSparseMoeBlock(cfg)
    elif family == "qwen3_moe":
        cfg = Qwen3MoeConfig(num_experts=e, moe_intermediate_size=inter, norm_topk_prob=False,
                             **common)
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        cfg = GptOssConfig(num_local_experts=e, intermediate_size=inter, **common)
        block = GptOssMLP(cfg)
    cfg._experts_implementation = impl
    with torch.no_grad():
        if family == "gpt_oss":
            inter_leaved = torch.stack([full["w1"], full["w3"]], dim=2).reshape(e, 2 * inter, -1)
            block.experts.gate_up_proj.copy_(inter_leaved.transpose(1, 2))
            block.experts.gate_up_proj_bias.copy_(
                torch.stack([full["b1"], full["b3"]], dim=2).reshape(e, -1))
            block.experts.down_proj.copy_(full["w2"].transpose(1, 2))
            block.experts.down_proj_bias.copy_(full["b2"])
            block.router.weight.normal_()
            block.router.bias.normal_()
        else:
            block.experts.gate_up_proj.copy_(torch.cat([full["w1"], full["w3"]], dim=1))
            block.experts.down_proj.copy_(full["w2"])
            block.gate.weight.normal_()
    return block


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_equals_transformers_moe_blocks(family, impl):
    """Router and experts, float32, bit for bit against transformers' own block in both of
    its experts implementations: its eager loop against ours, its grouped_mm path against
    our grouped path."""
    from transformers import Qwen3MoeConfig  # noqa: F401  (the families' configs load)
    gpt_oss = family == "gpt_oss"
    layer, full = random_moe(num_experts=8, top_k=2, bias=gpt_oss,
                             activation="swigluoai" if gpt_oss else "silu", transposed=gpt_oss)
    if family == "qwen3_moe":
        layer.router = functools.partial(routing.softmax_topk, top_k=2, renormalize=False,
                                         weights_dtype=torch.float32)
    torch.manual_seed(3)
    block = _hf_block(family, layer, full, 2, impl).eval()
    x = torch.randn(1, 37, 64)
    gate = block.router if gpt_oss else block.gate
    logits = torch.nn.functional.linear(x[0], gate.weight, getattr(gate, "bias", None))
    with torch.no_grad():
        want = block(x)
        want = (want[0] if isinstance(want, tuple) else want)[0]
        layer.impl = "loop" if impl == "eager" else "grouped"
        got = layer(x[0], logits)
    assert len(torch.unique(layer.router(logits)[1])) >= 6
    assert torch.equal(got, want), (got - want).abs().max()


def test_routers_match_transformers():
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    torch.manual_seed(0)
    x = torch.randn(50, 32)
    cases = [
        (MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8,
                                         num_experts_per_tok=2)),
         functools.partial(routing.softmax_topk, top_k=2, renormalize=True)),
        (Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3,
                                           norm_topk_prob=True)),
         functools.partial(routing.softmax_topk, top_k=3, renormalize=True,
                           weights_dtype=torch.float32)),
        (GptOssTopKRouter(GptOssConfig(hidden_size=32, num_local_experts=8,
                                       num_experts_per_tok=4)),
         functools.partial(routing.topk_softmax, top_k=4)),
    ]
    for hf, ours in cases:
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_()
            _, want_w, want_ids = hf(x)
            logits = torch.nn.functional.linear(x, hf.weight, getattr(hf, "bias", None))
        got_w, got_ids = ours(logits)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)


def test_stacked_and_per_expert_loading_agree_and_incomplete_loads_are_named():
    a, full = random_moe(num_experts=4)
    b, _ = random_moe(num_experts=4, seed=9)
    b.weights_processed = False
    b._loaded.clear()
    b.weight_loader(b.w13_weight, full["w1"], None, "w1")
    assert not b.loaded_completely()
    assert b.missing_weights() == ["layers.0.mlp.experts.w13_weight",
                                   "layers.0.mlp.experts.w2_weight"]
    b.weight_loader(b.w13_weight, full["w3"], None, "w3")
    b.weight_loader(b.w2_weight, full["w2"], None, "w2")
    assert b.loaded_completely() and b.weights_processed
    assert torch.equal(a.w13_weight, b.w13_weight) and torch.equal(a.w2_weight, b.w2_weight)
    with pytest.raises(ValueError, match=r"w13_weight \(expert 1, w1\) has shape \(8, 64\), "
                                         r"the config implies \(32, 64\)"):
        b.weight_loader(b.w13_weight, torch.zeros(8, 64), 1, "w1")
    with pytest.raises(ValueError, match="shard_id must be 'w1' \\(gate\\) or 'w3'"):
        b.weight_loader(b.w13_weight, full["w1"][0], 0, "gate")


def test_tensor_parallel_shards_sum_to_the_whole():
    """Two ranks' shards (each expert's intermediate size split) add up to the whole layer's
    output: the down bias is added on rank 0 only."""
    from quire import parallel_state as ps
    whole, full = random_moe(num_experts=6, bias=True, activation="swigluoai")
    x, logits = routed(30, 6)
    want = whole(x, logits)
    parts = []
    for rank in range(2):
        with ps.shard_as(rank, 2):
            shard, _ = random_moe(num_experts=6, bias=True, activation="swigluoai")
        shard._loaded.clear()
        shard.weights_processed = False
        from moe_helpers import load_into
        load_into(shard, full)
        assert shard.intermediate_size == 16 and shard.adds_w2_bias == (rank == 0)
        parts.append(shard.experts(x, *shard.router(logits)))
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-5)


def test_errors_name_the_field():
    with pytest.raises(ValueError, match="num_experts_per_tok \\(9\\) must be between 1 and"):
        random_moe(num_experts=8, top_k=9)
    with pytest.raises(ValueError, match="activation must be one of silu, swigluoai"):
        random_moe(activation="gelu")


def test_align_pads_each_experts_run_to_whole_blocks():
    from quire.layers.fused_moe.triton_moe import align
    ids = torch.tensor([[0, 2], [2, 3], [0, 2], [3, 0]])
    sorted_ids, block_experts, num_padded = align(ids, 4, 4)
    s = ids.numel()
    assert num_padded.item() == 12  # experts 0, 2, 3 used: three blocks of 4
    runs = sorted_ids[:12].view(3, 4)
    assert runs[0].tolist() == [0, 4, 7, s] and runs[1].tolist() == [1, 2, 5, s]
    assert runs[2].tolist() == [3, 6, s, s]
    assert block_experts[:3].tolist() == [0, 2, 3]
    assert (sorted_ids[12:] == s).all()


def test_triton_kernel_in_the_interpreter(tmp_path):
    suite = Path(__file__).with_name("fused_moe_triton_suite.py")
    assert run_triton_interpreter_suite(suite, tmp_path) >= 6
