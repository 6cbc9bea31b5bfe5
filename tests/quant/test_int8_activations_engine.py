"""An engine with `--activation-quantization int8` (native/int8_activations.h; the kernel's
own tests: tests/runtime/test_int8_activations.py) on a tiny random Llama quantized to int4 on
load."""

from __future__ import annotations

import pytest
from moe_helpers import save_tiny_moe, tiny_moe_config

from quire import LLM, SamplingParams, platform
from quire.native import quant_matmul as qm

from runtime_helpers import assert_no_blocks_in_use, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _greedy(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_rounds_its_int4_layers_and_keeps_one_answer_per_prompt(tiny_llama, dtype):
    """Quantized on load to int4, with int8 activations: every int4 layer takes them, the
    output is the same alone or batched (one order per row at any M), near itself in small
    prefill chunks and near the float-activation engine, and every KV block comes back."""
    kw = dict(dtype=dtype, quantization="int4", kv_cache_memory=32 << 20)
    llm = LLM(tiny_llama, activation_quantization="int8", **kw)
    packs = qm.packed_weights(llm.engine.executor.model)
    int4 = [p for p in packs if p.bits == 4]
    assert int4 and all(p.int8_activations for p in int4)
    prompts = random_prompts(lengths=[1, 7, 16, 17, 33, 100])
    together = _greedy(llm, prompts)
    alone = [_greedy(llm, [p])[0] for p in prompts]
    assert together == alone
    assert_no_blocks_in_use(llm)
    # Prefill chunks, verification rows and decode rows run different attention kernels,
    # whose results differ in their last bits with float x too (prompt logprobs against
    # decode logprobs, in float32); rounding x to int8 can turn one such bit into a step of
    # its grid, and the difference then grows to the rounding's own size. A tiny random
    # model's next-token distribution is nearly flat (top logprobs ~0.001-0.01 apart), so
    # such noise flips its greedy picks: chunked prefill, and the float-x engine, are held to
    # a bound on the first pick instead, its logprob under the other engine within
    # PICK_MARGIN of that engine's best (a random token lands ~2 below).
    chunked = LLM(tiny_llama, activation_quantization="int8", max_num_batched_tokens=16,
                  enable_prefix_caching=False, **kw)
    _assert_picks_near_the_best(chunked, llm, prompts, PICK_MARGIN[dtype])
    assert_no_blocks_in_use(chunked)
    exact = LLM(tiny_llama, **kw)
    assert not any(p.int8_activations for p in qm.packed_weights(exact.engine.executor.model))
    _assert_picks_near_the_best(llm, exact, prompts, PICK_MARGIN[dtype])


# int8 rounding moves a tiny model's logprobs by ~0.01 (0.0085 measured for one token); in
# bfloat16 the logits themselves are ~0.016-0.03 apart (an ulp at 2-4), and one gap measured
# 0.0156
PICK_MARGIN = {"float32": 0.05, "bfloat16": 0.15}
FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=20)


def _assert_picks_near_the_best(llm, reference, prompts, margin):
    """llm's greedy first token, for each prompt, is among reference's top 20 with a logprob
    within `margin` of reference's best."""
    ask = [{"prompt_token_ids": p} for p in prompts]
    picks = [o.outputs[0].token_ids[0] for o in llm.generate(ask, FIRST, use_tqdm=False)]
    for pick, out in zip(picks, reference.generate(ask, FIRST, use_tqdm=False)):
        top = out.outputs[0].logprobs[0]
        best = max(v.logprob for v in top.values())
        assert pick in top and best - top[pick].logprob <= margin, (pick, best)


def test_an_moe_engine_rounds_for_its_int4_experts(tmp_path, smollm_tokenizer):
    """MoE experts are packed weights too: an int4 MoE's experts take int8 activations, the
    answer does not depend on the batch, and every block comes back."""
    path = save_tiny_moe(str(tmp_path / "moe"), tiny_moe_config("mixtral"), smollm_tokenizer)
    llm = LLM(path, quantization="int4", dtype="float32", activation_quantization="int8",
              kv_cache_memory=4 << 20)
    model = llm.engine.executor.model
    experts = [k.packed for m in model.modules()
               for ks in (getattr(m, "expert_kernels", None) or {}).values() for k in ks]
    assert len(experts) == 3 * 2 * 8 and all(p.int8_activations for p in experts)
    prompts = random_prompts(lengths=[3, 9, 20])
    together = _greedy(llm, prompts)
    assert together == [_greedy(llm, [p])[0] for p in prompts]
    assert_no_blocks_in_use(llm)


def test_int8_weights_take_them_where_the_cpu_has_vnni(tiny_llama):
    """Quantized on load to int8 (GGUF's Q8_0 form): with AVX512-VNNI every int8 layer rounds
    x too (VNNI rows, the AMX int8 tiles from 5 rows), elsewhere it keeps float x; either way
    a prompt's answer is the same alone or batched, and every KV block comes back."""
    llm = LLM(tiny_llama, dtype="float32", quantization="int8", activation_quantization="int8",
              kv_cache_memory=32 << 20)
    int8 = [p for p in qm.packed_weights(llm.engine.executor.model) if p.bits == 8]
    assert int8
    vnni = "avx512_vnni" in platform.cpu_flags()  # (the native build's -march)
    assert all(p.int8_activations == vnni for p in int8), qm.isa()
    prompts = random_prompts(lengths=[1, 6, 17, 40])
    together = _greedy(llm, prompts)
    assert together == [_greedy(llm, [p])[0] for p in prompts]
    assert_no_blocks_in_use(llm)
