"""Checkpoints quantized by the ecosystem's own tools, loaded kept quantized: Quire at float32
on the quantized folder against transformers on the same weights as the tool's own library
dequantizes them (fp32). Each variant: the layers hold the file's format (no float weight),
the dequantized weights are the library's exactly, greedy output is identical on at least 11
of 12 sequences, and the first step's logprobs are within LOGPROB_BOUND."""

from __future__ import annotations

import pytest
import torch

from quire import LLM, SamplingParams
from quire.layers.quantization import describe

import prequantized_writers as writers
from quant_helpers import agreement, dequantized_state_dict, hf_with_weights
from runtime_helpers import assert_no_blocks_in_use, hf_greedy, hf_model, random_prompts

NEW_TOKENS = 16
# the same fp32 weights on both sides; only the order of fp32 sums differs (~1e-6 relative)
LOGPROB_BOUND = 1e-4

# (tool, how it writes, what the layers hold, the library's dequantizer)
VARIANTS = {
    "ct-W4A16": (lambda p, t: writers.write_compressed_tensors(p, t, "W4A16", group_size=64),
                 "int4", writers.dequantized_compressed_tensors),
    "ct-W4A16_ASYM": (lambda p, t: writers.write_compressed_tensors(p, t, "W4A16_ASYM"),
                      "int4", writers.dequantized_compressed_tensors),
    "ct-W4A16-naive": (lambda p, t: writers.write_compressed_tensors(
        p, t, "W4A16", fmt="naive-quantized", group_size=32),
        "int4", writers.dequantized_compressed_tensors),
    "ct-W8A16": (lambda p, t: writers.write_compressed_tensors(p, t, "W8A16"),
                 "int8", writers.dequantized_compressed_tensors),
    "ct-FP8": (lambda p, t: writers.write_compressed_tensors(p, t, "FP8"),
               "fp8", writers.dequantized_compressed_tensors),
    "ct-FP8_DYNAMIC": (lambda p, t: writers.write_compressed_tensors(p, t, "FP8_DYNAMIC"),
                       "fp8", writers.dequantized_compressed_tensors),
    "ct-FP8_BLOCK": (lambda p, t: writers.write_compressed_tensors(p, t, "FP8_BLOCK"),
                     "fp8", writers.dequantized_compressed_tensors),
    "gptq-4bit-sym": (lambda p, t: writers.write_auto_round(p, t, "auto_gptq", 4, 32, True),
                      "int4", writers.dequantized_gptq),
    "gptq-4bit-asym": (lambda p, t: writers.write_auto_round(p, t, "auto_gptq", 4, 64, False),
                       "int4", writers.dequantized_gptq),
    "gptq-8bit-sym": (lambda p, t: writers.write_auto_round(p, t, "auto_gptq", 8, 128, True),
                      "int8", writers.dequantized_gptq),
    "awq": (lambda p, t: writers.write_auto_round(p, t, "auto_awq", 4, 32, False),
            "int4", writers.dequantized_awq),
    "hf-fp8-blocks": (writers.write_hf_fp8, "fp8", writers.dequantized_hf_fp8),
    # no tool here writes act-order: packed by the test from the format's reference
    "gptq-act-order-reference-packer": (writers.write_gptq_act_order_reference, "int4",
                                        writers.dequantized_gptq_reference),
}


def _first_logprobs(hf, prompts):
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0, -1].float(), -1)
                for p in prompts]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prequantized_checkpoint_matches_transformers_on_the_library_dequantized_weights(
        variant, tmp_path, smollm_tokenizer):
    write, kind, dequantize = VARIANTS[variant]
    path = write(str(tmp_path / variant), smollm_tokenizer)
    llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20)
    model = llm.engine.executor.model
    layer = model.layers[0].gate_up_proj
    assert layer.quant_method.kind == kind and not hasattr(layer, "weight_packed")
    assert describe(model).startswith(f"{kind} ") and describe(model).endswith(" x8")
    # the values Quire multiplies by are the library's own, exactly
    ours = dequantized_state_dict(model)
    reference = dequantize(path)
    for name, w in ours.items():
        assert torch.equal(w, reference[name].float()), name
    prompts = random_prompts()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_no_blocks_in_use(llm)
    got = [o.outputs[0].token_ids for o in outs]
    hf = hf_with_weights(hf_model(_float_twin(tmp_path, smollm_tokenizer)), reference)
    want = hf_greedy(hf, prompts, NEW_TOKENS)
    identical, first = agreement(want, got)
    print(f"{variant}: {identical}/{len(prompts)} identical, first divergence {first:.1f}")
    assert identical >= len(prompts) - 1
    for o, ref in zip(outs, _first_logprobs(hf, prompts)):
        for token, lp in o.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - ref[token].item()) < LOGPROB_BOUND, (variant, token)


def _float_twin(tmp_path, tokenizer) -> str:
    """The tiny Llama's architecture as a float folder: what transformers builds the oracle
    from (its weights are then replaced by the library-dequantized ones)."""
    path = tmp_path / "float-twin"
    if not path.exists():
        writers.tiny_float_model(torch.float32).save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
    return str(path)
