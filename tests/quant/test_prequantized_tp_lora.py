"""A pre-quantized checkpoint under tensor parallelism and with LoRA: GPTQ act-order (the
reference packer's, see prequantized_writers) at tensor-parallel size 2, each rank reading its
shard (its columns' g_idx, every group's scales on the row-parallel layers), and a PEFT
adapter on top of the quantized base; both against transformers on the library-dequantized
weights (plus the merged adapter)."""

from __future__ import annotations

import torch

from quire import LLM, LoRARequest, SamplingParams

import prequantized_writers as writers
from lora_helpers import merged_reference_model, save_random_adapter
from quant_helpers import agreement, hf_with_weights
from runtime_helpers import assert_no_blocks_in_use, hf_greedy, hf_model, random_prompts

NEW_TOKENS = 12


def _float_folder(path: str, state: dict[str, torch.Tensor], tokenizer) -> str:
    """The dequantized weights as a float folder (PEFT merges an adapter into it)."""
    model = hf_with_weights(writers.tiny_float_model(torch.float32), state)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_act_order_gptq_at_two_ranks_and_with_lora(tmp_path, smollm_tokenizer):
    path = writers.write_gptq_act_order_reference(str(tmp_path / "gptq"), smollm_tokenizer)
    state = writers.dequantized_gptq_reference(path)
    dense = _float_folder(str(tmp_path / "dense"), state, smollm_tokenizer)
    prompts = random_prompts(lengths=[1, 16, 33, 100])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = hf_greedy(hf_model(dense), prompts, NEW_TOKENS)

    two = LLM(path, dtype="float32", tensor_parallel_size=2, num_threads=1,
              kv_cache_memory=16 << 20)
    try:
        outs = two.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_no_blocks_in_use(two)
    finally:
        two.engine.shutdown()
    identical, _ = agreement(want, [o.outputs[0].token_ids for o in outs])
    # the all-reduce adds the ranks' partial sums in another fp32 order: near-ties only
    assert identical >= len(prompts) - 1

    adapter = save_random_adapter(dense, str(tmp_path / "adapter"), r=4, std=0.05)
    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8,
              kv_cache_memory=16 << 20)
    assert llm.engine.executor.model.layers[0].qkv_proj.quant_method.kind == "int4"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, adapter))
    got = [o.outputs[0].token_ids for o in outs]
    reference = hf_greedy(merged_reference_model(dense, adapter), prompts, NEW_TOKENS)
    identical, _ = agreement(reference, got)
    assert identical >= len(prompts) - 1 and got != want  # the adapter changed the output
