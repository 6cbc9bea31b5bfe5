"""Quantized models against transformers run on the same (dequantized) weights: a tiny random
Llama quantized on load (int8 per channel, int4 per group), and SmolLM2's GGUF read with its
own quantization (auto) and its Q8_0 embedding / tied LM head. Engines free every KV block."""

from __future__ import annotations

import pytest
import torch

from quire import LLM, SamplingParams
from quire.layers.quantization import describe

from quant_helpers import agreement, dequantized_state_dict, hf_with_weights
from runtime_helpers import (
    TINY_MAX_NEW_TOKENS,
    assert_no_blocks_in_use,
    hf_greedy,
    hf_model,
    random_prompts,
    smollm2_hf_greedy,
)

GREEDY = SamplingParams(temperature=0, max_tokens=TINY_MAX_NEW_TOKENS, ignore_eos=True)


def _quire_greedy(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("quantization,group", [("int8", 32), ("int4", 32), ("int4", 64)])
def test_tiny_llama_quantized_matches_transformers_on_dequantized_weights(
        tiny_llama, quantization, group):
    path = tiny_llama
    llm = LLM(path, dtype="float32", quantization=quantization,
              quantization_group_size=group, kv_cache_memory=32 << 20)
    layer = llm.engine.executor.model.layers[0]
    assert layer.qkv_proj.qweight.dtype == (torch.int8 if quantization == "int8"
                                            else torch.uint8)
    assert not hasattr(layer.qkv_proj, "weight")  # the float weight is gone
    summary = describe(llm.engine.executor.model)  # what the start-up log says: 4 linears x 3 layers
    assert summary.startswith(f"{quantization} ") and summary.endswith(" x12"), summary
    prompts = random_prompts(lengths=[1, 7, 16, 17, 33, 100, 300])
    got = _quire_greedy(llm, prompts)
    assert_no_blocks_in_use(llm)
    hf = hf_with_weights(hf_model(path), dequantized_state_dict(llm.engine.executor.model))
    want = hf_greedy(hf, prompts, TINY_MAX_NEW_TOKENS)
    identical, first = agreement(want, got)
    print(f"{quantization} G={group}: {identical}/{len(prompts)} sequences identical, "
          f"mean first divergence {first:.1f}/{TINY_MAX_NEW_TOKENS}")
    # Same fp32 weights on both sides; only the kernels' sum order may differ (fp32
    # reordering, ~1e-6 relative), which flips a greedy pick only at a near-tie. Random tiny
    # models have few of those: allow one sequence in seven to diverge, never the first token.
    assert identical >= len(prompts) - 1
    assert all(g[0] == w[0] for g, w in zip(got, want))


def test_int8_int4_quantized_model_differs_from_float_but_stays_close(tiny_llama):
    """Quantizing really happened (weights changed) and was not destructive (the logits of
    the first token stay close to the float model's)."""
    path = tiny_llama
    float_state = dequantized_state_dict(LLM(path, dtype="float32", quantization="none",
                                             kv_cache_memory=16 << 20).engine.executor.model)
    for quantization, tol in (("int8", 0.02), ("int4", 0.3)):
        state = dequantized_state_dict(LLM(path, dtype="float32", quantization=quantization,
                                           kv_cache_memory=16 << 20).engine.executor.model)
        name = "model.layers.0.mlp.down_proj.weight"
        err = (state[name] - float_state[name]).abs().max() / float_state[name].abs().max()
        assert 0 < err < tol, (quantization, err)


def test_smollm2_gguf_auto_keeps_its_quantization_and_matches_transformers(smollm_tokenizer):
    """The default model with auto: Q4_1 layers as int4 and the Q8_0 embedding (and tied
    head) as int8, the file's values exactly, so transformers loading the same GGUF (its own
    dequantization) is the oracle. A few chat prompts, a few tokens: cheap (after the first
    run, which writes the quantized conversion cache)."""
    llm = LLM(dtype="float32", quantization="auto", kv_cache_memory=32 << 20)
    model = llm.engine.executor.model
    assert model.layers[0].gate_up_proj.quant_method.kind == "int4"
    assert model.embed_tokens.table_method.kind == "int8" and model.lm_head.tied
    assert model.lm_head.quant_method.kind == "int8"
    chats = [[{"role": "user", "content": c}] for c in
             ("What is the capital of France?", "Write a haiku about the sea.",
              "List three prime numbers.")]
    texts = [smollm_tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
             for c in chats]
    prompts = [smollm_tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = _quire_greedy(llm, prompts, params)
    assert_no_blocks_in_use(llm)
    want = smollm2_hf_greedy(prompts, 8)
    identical, first = agreement(want, got)
    print(f"SmolLM2 auto: {identical}/{len(prompts)} identical, mean first divergence {first}")
    assert identical >= len(prompts) - 1 and all(g[:2] == w[:2] for g, w in zip(got, want))


def test_bfloat16_prefill_on_the_matrix_engine_agrees_with_the_native_kernels(
        tiny_llama, monkeypatch):
    """A bfloat16 int4 model with QUIRE_MATRIX_ENGINE=1 (what an AMX host picks when it
    measures faster): prefill chunks of 64+ rows take the bfloat16 GEMM, decode stays native.
    Its greedy output agrees with the all-native run up to bfloat16 weight rounding: the
    token the prefill picks for every prompt, and the decode after it for several tokens on
    average (a random tiny model in bfloat16 is full of near-ties: on the AVX2 EPYC two of
    four sequences ran identical to 12 tokens, the others diverged at 5 and 9)."""
    from quire.native import matrix_engine
    prompts = random_prompts(lengths=[7, 64, 100, 300])
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("QUIRE_MATRIX_ENGINE", setting)
        llm = LLM(tiny_llama, dtype="bfloat16", quantization="int4",
                  quantization_group_size=32, kv_cache_memory=32 << 20)
        before = matrix_engine.calls
        runs[setting] = _quire_greedy(llm, prompts)
        taken = matrix_engine.calls - before
        assert_no_blocks_in_use(llm)
        # each prefill step of 64+ rows: 4 linears x 3 layers (the lm_head stays float)
        assert (taken == 0) if setting == "0" else (taken >= 12 and taken % 12 == 0), taken
    _, first = agreement(runs["0"], runs["1"])
    assert all(a[0] == b[0] for a, b in zip(runs["0"], runs["1"]))
    assert first >= 4, first
