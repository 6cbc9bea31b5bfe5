"""LoRA on the 2026 dense families: a PEFT adapter on all seven projections of each (written by
`peft` itself) gives transformers + PEFT (merged) greedy output, beside the base model in one
batch. Phi-3's checkpoint fuses qkv and gate_up, so PEFT targets those fused modules there:
Quire refuses such an adapter with a clear error (its LoRA slots are per usual module)."""

from __future__ import annotations

import pytest

from quire import LLM, LoRARequest, SamplingParams

from lora_helpers import (
    hf_greedy,
    hf_model,
    merged_reference_model,
    random_prompts,
    save_random_adapter,
    save_tiny_model,
    smollm2_tokenizer,
    tiny_config,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2"])  # three layer shapes
def test_adapter_on_every_projection_matches_peft_merged(family, tmp_path):
    base = save_tiny_model(str(tmp_path / "base"), tiny_config(family), smollm2_tokenizer())
    adapter = save_random_adapter(base, str(tmp_path / "a"), r=8, lora_alpha=8, seed=3,
                                  std=0.06)
    prompts = random_prompts(lengths=[1, 17, 40, 100], seed=5)
    expected = hf_greedy(merged_reference_model(base, adapter), prompts, 12)
    base_expected = hf_greedy(hf_model(base), prompts, 12)
    assert expected != base_expected  # else the parity would prove nothing
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory=8 << 20, max_num_batched_tokens=32)
    lora = LoRARequest("a", 1, adapter)
    outs = llm.generate(prompts * 2, GREEDY, use_tqdm=False,
                        lora_request=[lora] * len(prompts) + [None] * len(prompts))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected + base_expected
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_phi3_fused_module_adapter_is_refused_naming_the_module(tmp_path):
    base = save_tiny_model(str(tmp_path / "base"), tiny_config("phi3"), smollm2_tokenizer())
    adapter = save_random_adapter(base, str(tmp_path / "a"), r=4, targets=["qkv_proj"])
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory=8 << 20)
    with pytest.raises(ValueError, match="qkv_proj"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("a", 1, adapter))


def test_mixture_of_experts_takes_attention_adapters_and_refuses_expert_ones(tmp_path):
    """LoRA on a MoE model serves the attention projections (the experts are a fused layer
    with no LoRA slot): an attention adapter matches transformers + PEFT merged; one that
    targets the experts is refused at load, naming what is served."""
    from moe_helpers import save_tiny_moe, tiny_moe_config
    base = save_tiny_moe(str(tmp_path / "base"), tiny_moe_config("mixtral"),
                         smollm2_tokenizer())
    adapter = save_random_adapter(base, str(tmp_path / "a"), r=8, lora_alpha=8, seed=4,
                                  std=0.06, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    prompts = random_prompts(lengths=[1, 17, 40, 100], seed=6)
    expected = hf_greedy(merged_reference_model(base, adapter), prompts, 12)
    assert expected != hf_greedy(hf_model(base), prompts, 12)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory=8 << 20, max_num_batched_tokens=32)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, adapter))
    assert [o.outputs[0].token_ids for o in outs] == expected
    experts = save_random_adapter(base, str(tmp_path / "e"), r=4, targets=["w1", "w3"])
    with pytest.raises(ValueError, match="serves LoRA on"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("e", 2, experts))
