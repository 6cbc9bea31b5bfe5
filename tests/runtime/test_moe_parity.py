"""Mixtral, Qwen3-MoE and gpt-oss give transformers' float32 greedy output token for token on
tiny random models (8 experts, top-2, several experts chosen per batch; gpt-oss's 32-token
windows under the prompts' 300): in one engine with 48-token chunked prefill and a KV budget
small enough to preempt, then again with prefix-cache hits. Also: quantized experts against
transformers on the dequantized weights, and the parameter counts the server logs."""

from __future__ import annotations

import pytest
import torch
from moe_helpers import MOE_FAMILIES, save_tiny_moe, tiny_moe_config

from quire import LLM, SamplingParams
from quire.layers.fused_moe import FusedMoE
from quire.worker.kv_cache import bytes_per_block
from quire.worker.model_builder import parameter_bytes

from runtime_helpers import hf_greedy, hf_model, random_prompts

MAX_TOKENS = 16
PROMPT_LENGTHS = [1, 7, 17, 33, 64, 150, 257, 300]  # transformers' side is the slow one


def _kv_budget(cfg, num_blocks: int) -> int:
    return num_blocks * bytes_per_block(cfg.num_hidden_layers, 16, cfg.num_key_value_heads,
                                        cfg.head_dim, torch.float32)


def _greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _diverging(got, expected, prompts):
    return [f"prompt {i} (len {len(prompts[i])}) at token "
            f"{next(j for j, (a, b) in enumerate(zip(g + [-1], e + [-2])) if a != b)}"
            for i, (g, e) in enumerate(zip(got, expected)) if g != e]


def _record_experts(model) -> list[set]:
    """Wraps each MoE layer's router to collect the experts it picks, per step."""
    seen = []
    for layer in model.layers:
        if layer.experts is None:
            continue
        route = layer.experts.router

        def recording(logits, route=route):
            weights, ids = route(logits)
            seen.append(set(ids.flatten().tolist()))
            return weights, ids
        layer.experts.router = recording
    return seen


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_family_matches_transformers_chunked_preempted_and_cached(family, tmp_path,
                                                                      smollm_tokenizer):
    cfg = tiny_moe_config(family)
    path = save_tiny_moe(str(tmp_path / family), cfg, smollm_tokenizer)
    prompts = random_prompts(lengths=PROMPT_LENGTHS)
    expected = hf_greedy(hf_model(path), prompts, MAX_TOKENS)

    need = -(-(max(map(len, prompts)) + MAX_TOKENS) // 16)  # the longest request's blocks
    llm = LLM(path, dtype="float32", max_num_batched_tokens=48, enable_prefix_caching=True,
              kv_cache_memory=_kv_budget(cfg, need + 6))
    model = llm.engine.executor.model
    seen = _record_experts(model)
    assert _diverging(_greedy(llm, prompts), expected, prompts) == []
    assert max(map(len, seen)) >= 6, "a step should route its tokens to most experts"
    engine = llm.engine
    assert engine.scheduler.num_preemptions["recompute"] > 0, "no preemption happened"
    hits_before = engine.kv_manager.prefix_hits
    assert _diverging(_greedy(llm, prompts), expected, prompts) == []
    assert engine.kv_manager.prefix_hits > hits_before, "no prefix-cache hit happened"
    assert engine.kv_manager.pool.num_used_blocks == 0
    sparse = [layer.experts is not None for layer in model.layers]
    assert sparse == ([True, False, True] if family == "qwen3_moe" else [True] * 3)
    if family == "gpt_oss":  # sliding, full, sliding
        assert [layer.backend.sliding_window for layer in model.layers] == [32, None, 32]


def test_gpt_oss_sinks_and_window_change_transformers_output(tmp_path, smollm_tokenizer):
    """The tiny gpt-oss exercises both: its next-token logprobs move without either."""
    prompts = random_prompts()[-3:]  # past the window

    def last_logprobs(model):
        with torch.no_grad():
            return [model(torch.tensor([p])).logits[0, -1].log_softmax(-1) for p in prompts]

    path = save_tiny_moe(str(tmp_path / "g"), tiny_moe_config("gpt_oss"), smollm_tokenizer)
    base = last_logprobs(hf_model(path))
    wide = save_tiny_moe(str(tmp_path / "w"), tiny_moe_config("gpt_oss", sliding_window=4096),
                         smollm_tokenizer)
    no_sinks = hf_model(path)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
    for other in (last_logprobs(hf_model(wide)), last_logprobs(no_sinks)):
        assert max((a - b).abs().max().item() for a, b in zip(base, other)) > 1e-2


def _dequantized_mixtral_state(model) -> dict[str, torch.Tensor]:
    """Quire's Mixtral as transformers' in-memory names, every weight as the fp32 values
    Quire multiplies by."""
    from quire.layers.quantization import FloatLinearMethod

    def weight(linear):
        if isinstance(linear.quant_method, FloatLinearMethod):
            return linear.weight.detach().float()
        return linear.quant_method.dequantized(linear)

    out = {}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = weight(layer.qkv_proj).split(layer.qkv_proj.output_sizes)
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v,
                    p + "self_attn.o_proj.weight": weight(layer.o_proj),
                    p + "mlp.experts.gate_up_proj": layer.experts.dense_weights("w13"),
                    p + "mlp.experts.down_proj": layer.experts.dense_weights("w2")})
    return out


@pytest.mark.parametrize("quantization,group", [("int8", None), ("int4", 32)])
def test_quantized_experts_match_transformers_on_the_dequantized_weights(
        quantization, group, tmp_path, smollm_tokenizer):
    cfg = tiny_moe_config("mixtral")
    path = save_tiny_moe(str(tmp_path / "m"), cfg, smollm_tokenizer)
    group_kw = {"quantization_group_size": group} if group else {}  # int8: per channel
    llm = LLM(path, dtype="float32", quantization=quantization,
              kv_cache_memory=_kv_budget(cfg, 200), **group_kw)
    experts = llm.engine.executor.model.layers[0].experts
    assert experts.method.kind == quantization  # kept in its format, no float copy
    assert not hasattr(experts, "w13_weight") and experts.expert_kernels is not None
    prompts = random_prompts(lengths=[1, 7, 17, 100, 300])
    got = _greedy(llm, prompts)
    hf = hf_model(path)
    state = _dequantized_mixtral_state(llm.engine.executor.model)
    with torch.no_grad():
        own = hf.state_dict()
        for name, t in state.items():
            own[name].copy_(t)
    want = hf_greedy(hf, prompts, MAX_TOKENS)
    # same fp32 weights on both sides, only the kernels' sum order differs: a near-tie may
    # flip one sequence late, never the first token
    assert sum(g == w for g, w in zip(got, want)) >= len(prompts) - 1
    assert all(g[0] == w[0] for g, w in zip(got, want))


def test_parameter_counts_and_bytes_include_the_experts(tmp_path, smollm_tokenizer):
    cfg = tiny_moe_config("mixtral")
    path = save_tiny_moe(str(tmp_path / "m"), cfg, smollm_tokenizer)
    model = LLM(path, dtype="float32", kv_cache_memory=1 << 20).engine.executor.model
    hf = hf_model(path)
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    counts = model.parameter_count
    assert counts.total == total
    assert counts.active(model) == total - experts + experts * 2 // 8
    assert counts.describe(model).endswith("active per token (8 experts, 2 per token)")
    def expert_bytes(model):  # parameters and packed copies: what the KV budget leaves room for
        return sum(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                   + m.extra_weight_bytes() for m in model.modules() if isinstance(m, FusedMoE))

    assert expert_bytes(model) == experts * 4
    q = LLM(path, dtype="float32", quantization="int8", kv_cache_memory=1 << 20).engine.executor.model
    assert q.layers[0].experts.extra_weight_bytes() > 0  # the native kernels' packed copies
    assert experts < expert_bytes(q) < experts * 4 * 0.4  # ~1 byte a weight, plus scales
    # parameter_bytes (what a tensor-parallel worker reports) counts them
    assert parameter_bytes(model) - parameter_bytes(q) > 0.55 * experts * 4


def test_unsupported_expert_tensors_are_refused_in_one_line(tmp_path, smollm_tokenizer):
    """A pre-quantized MoE checkpoint (experts stored as, say, compressed-tensors' packed
    weights) is refused naming the tensor, not loaded as garbage."""
    from safetensors.torch import load_file, save_file
    path = save_tiny_moe(str(tmp_path / "m"), tiny_moe_config("mixtral"), smollm_tokenizer)
    tensors = load_file(f"{path}/model.safetensors")
    name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    tensors[name.replace(".weight", ".weight_packed")] = tensors.pop(name).to(torch.int32)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        LLM(path, dtype="float32", kv_cache_memory=1 << 20)
    message = str(e.value)
    assert "experts.0.w1.weight_packed" in message and "not supported" in message
    assert "\n" not in message
