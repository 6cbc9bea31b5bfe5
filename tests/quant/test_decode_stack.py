"""The native decode stack (quire/native/decode_stack.py): a decode-only step of a quantized
model, or of a bfloat16 float one (its native bf16 kernels), runs its decoder layers in one
native call, and gives bit for bit what the layer-by-layer Python path gives (same kernels,
same order), whatever the batch, window or dtype. Where a condition fails (float32 weights,
biases, fp8 KV, LoRA, turned off) the Python path runs. Engines free every KV block."""

from __future__ import annotations

import math

import pytest

from quire import LLM, SamplingParams

from runtime_helpers import (
    MODEL_FAMILIES,
    NEW_FAMILIES,
    assert_no_blocks_in_use,
    random_prompts,
    save_tiny_model,
    tiny_config,
)

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)


def _run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    assert_no_blocks_in_use(llm)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _count_calls(llm) -> list[int]:
    """[decode steps the stack served]; wraps the runner's stack."""
    stack = llm.engine.executor.runner.decode_stack
    served = [0]

    def counting(*args, **kwargs):
        out = type(stack).__call__(stack, *args, **kwargs)
        served[0] += out is not None
        return out

    llm.engine.executor.runner.decode_stack = counting
    return served


def _both(path, monkeypatch, prompts, **kwargs):
    """(with the stack, its decode steps served, without it) on the same prompts."""
    llm = LLM(path, kv_cache_memory=32 << 20, **kwargs)
    assert llm.engine.executor.runner.decode_stack is not None
    served = _count_calls(llm)
    with_stack = _run(llm, prompts)
    monkeypatch.setenv("QUIRE_DECODE_STACK", "0")
    plain = LLM(path, kv_cache_memory=32 << 20, **kwargs)
    assert plain.engine.executor.runner.decode_stack is None
    return with_stack, served[0], _run(plain, prompts)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("quantization,group", [("int8", 32), ("int4", 32), ("int4", 64)])
def test_a_quantized_model_decodes_bit_for_bit_as_the_python_path(
        tiny_llama, monkeypatch, dtype, quantization, group):
    # lengths that cross KV blocks, batched, so steps mix prefill and decode and decode
    # batches shrink as sequences finish at different times
    prompts = random_prompts(lengths=[1, 5, 16, 17, 40, 100, 150])
    with_stack, served, plain = _both(tiny_llama, monkeypatch, prompts, dtype=dtype,
                                      quantization=quantization,
                                      quantization_group_size=group)
    assert served >= PARAMS.max_tokens - 1  # every decode-only step
    assert with_stack == plain  # token ids and every logprob, exactly


def test_a_bfloat16_float_model_decodes_bit_for_bit_as_the_python_path(tiny_llama, monkeypatch):
    prompts = random_prompts(lengths=[1, 5, 17, 100, 150])  # 100, 150: oneDNN prefill chunks
    with_stack, served, plain = _both(tiny_llama, monkeypatch, prompts, dtype="bfloat16",
                                      quantization="none")
    assert served >= PARAMS.max_tokens - 1
    assert with_stack == plain


def test_a_sliding_window_model_decodes_bit_for_bit(tmp_path, smollm_tokenizer, monkeypatch):
    path = save_tiny_model(str(tmp_path / "mistral"), tiny_config("mistral"), smollm_tokenizer)
    prompts = random_prompts(lengths=[3, 47, 49, 120])  # around and past the 48-token window
    with_stack, served, plain = _both(path, monkeypatch, prompts, dtype="bfloat16",
                                      quantization="int4")
    assert served > 0
    assert with_stack == plain


def test_chunked_prefill_and_preemption_leave_the_stack_exact(tiny_llama, monkeypatch):
    # 3 layers x K and V x 2 KV heads x 16 dims x 2 bytes per token, 16 tokens a block:
    # 14 blocks for six sequences that need up to 6 each, so some are preempted mid-decode
    per_block = 3 * 2 * 2 * 16 * 2 * 16
    prompts = random_prompts(lengths=[30, 31, 32, 33, 60, 61])
    llm = LLM(tiny_llama, dtype="bfloat16", quantization="int4", max_num_batched_tokens=32,
              kv_cache_memory=14 * per_block)
    served = _count_calls(llm)
    with_stack = _run(llm, prompts)
    assert served[0] > 0
    assert llm.engine.scheduler.num_preemptions["recompute"] > 0, "no pressure: test is moot"
    monkeypatch.setenv("QUIRE_DECODE_STACK", "0")
    plain = LLM(tiny_llama, dtype="bfloat16", quantization="int4", max_num_batched_tokens=32,
                kv_cache_memory=14 * per_block)
    assert with_stack == _run(plain, prompts)


@pytest.mark.parametrize("kwargs", [
    dict(quantization="none", dtype="float32"),      # float32 weights: F.linear
    dict(quantization="int4", kv_cache_dtype="fp8_e4m3"),  # a KV cache not in the model dtype
    dict(quantization="int4", enable_lora=True),      # adapters add to every linear
])
def test_where_a_condition_fails_the_python_path_runs(tiny_llama, kwargs):
    llm = LLM(tiny_llama, kv_cache_memory=32 << 20, **{"dtype": "bfloat16", **kwargs})
    assert llm.engine.executor.runner.decode_stack is None
    tokens = _run(llm, random_prompts(lengths=[5, 20]))
    assert all(len(t) == PARAMS.max_tokens for t, _ in tokens)


def test_biases_keep_the_python_path(tmp_path, smollm_tokenizer):
    path = save_tiny_model(str(tmp_path / "qwen2"), tiny_config("qwen2"), smollm_tokenizer)
    llm = LLM(path, dtype="bfloat16", quantization="int8", kv_cache_memory=32 << 20)
    assert llm.engine.executor.runner.decode_stack is None  # q/k/v biases
    assert len(_run(llm, random_prompts(lengths=[9]))[0][0]) == PARAMS.max_tokens


def test_partial_rotary_keeps_the_python_path(tmp_path, smollm_tokenizer):
    """Phi-3 rotates 3/4 of each head (partial_rotary_factor): the stack, which rotates all of
    it, once read past each row of the cos / sin table (NaN logits, batch-dependent tokens).
    It is left to the Python path, which gives each prompt one answer, batched or alone."""
    path = save_tiny_model(str(tmp_path / "phi3"), tiny_config("phi3"), smollm_tokenizer)
    llm = LLM(path, dtype="float32", quantization="int4", kv_cache_memory=32 << 20)
    assert llm.engine.executor.model.rope.rotary_dim < llm.engine.executor.model.cfg.head_dim
    assert llm.engine.executor.runner.decode_stack is None
    prompts = random_prompts(lengths=[5, 40, 70])  # 70: past LongRoPE's switch at 64
    together = _run(llm, prompts)
    # (tokens: a logprob's last bit may follow the batch's shape, log_softmax's own split)
    assert [t for t, _ in together] == [_run(llm, [p])[0][0] for p in prompts]
    assert all(not math.isnan(v.logprob) for _, logprobs in together for d in logprobs
               for v in d.values())


@pytest.mark.parametrize("family", MODEL_FAMILIES + NEW_FAMILIES)
def test_every_family_decodes_the_same_with_or_without_the_stack(
        family, tmp_path, smollm_tokenizer, monkeypatch):
    """Whatever a family's layers hold (biases, q/k norms, windows, soft-capping, partial or
    per-layer RoPE), an int4 model's greedy tokens are the same whether the stack takes its
    decode steps or refuses them (Phi-3's partial rotary once got garbage from it)."""
    path = save_tiny_model(str(tmp_path / family), tiny_config(family), smollm_tokenizer)
    prompts = random_prompts(lengths=[5, 40, 70])
    kw = dict(dtype="float32", quantization="int4", kv_cache_memory=16 << 20)
    with_stack = [t for t, _ in _run(LLM(path, **kw), prompts)]
    monkeypatch.setenv("QUIRE_DECODE_STACK", "0")
    assert with_stack == [t for t, _ in _run(LLM(path, **kw), prompts)]


def test_turned_off_by_the_environment(tiny_llama, monkeypatch):
    monkeypatch.setenv("QUIRE_DECODE_STACK", "0")
    llm = LLM(tiny_llama, dtype="bfloat16", quantization="int4", kv_cache_memory=32 << 20)
    assert llm.engine.executor.runner.decode_stack is None


def test_the_stack_times_its_phases_when_asked(tiny_llama):
    llm = LLM(tiny_llama, dtype="bfloat16", quantization="int4", kv_cache_memory=32 << 20)
    stack = llm.engine.executor.runner.decode_stack
    assert stack.timings() == {}
    stack.profile()
    _run(llm, random_prompts(lengths=[5, 20]))
    phases = stack.timings()
    assert set(phases) >= {"qkv_proj", "attention", "down_proj"}
    assert all(t >= 0 for t in phases.values()) and phases["attention"] > 0
    stack.profile(False)
    assert stack.timings() == {}
    _run(llm, random_prompts(lengths=[3]))  # and runs on without the timers
