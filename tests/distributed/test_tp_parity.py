"""Tensor parallelism on CPU with gloo: two ranks give transformers' float32 greedy output
token for token, with chunked prefill, prefix caching and preemption in the same run; and
each rank holds half the weights."""

from __future__ import annotations

import pytest

from quire import LLM, SamplingParams
from quire.worker.model_builder import parameter_bytes

from tp_helpers import FAMILIES, TP, kv_budget_for
from tp_helpers import runtime_helpers as rh

MAX_TOKENS = 24


def _prompts():
    """The runtime tests' prompts (1-300 tokens) and three that share a long prefix with one
    of them, so the prefix cache has something to hit."""
    prompts = rh.random_prompts(10, seed=7)
    base = prompts[-1]  # 257 tokens
    return prompts + [base[:200] + [11, 12, 13], base[:130] + [21] * 9, list(base)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_match_transformers_with_chunks_prefix_hits_and_preemption(family,
                                                                              tp_models):
    from transformers import AutoConfig
    path = tp_models[family]
    prompts = _prompts()
    expected = rh.hf_greedy(rh.hf_model(path), prompts, MAX_TOKENS)

    need = -(-(max(map(len, prompts)) + MAX_TOKENS) // 16)  # blocks of the longest request
    llm = LLM(path, dtype="float32", tensor_parallel_size=TP, num_threads=1,
              kv_cache_memory=kv_budget_for(AutoConfig.from_pretrained(path), need + 4, TP),
              max_num_batched_tokens=64, enable_prefix_caching=True)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"prompt {i} (len {len(prompts[i])}) diverges from transformers"
        engine = llm.engine
        assert engine.scheduler.num_preemptions["recompute"] > 0, "no preemption happened"
        assert engine.kv_manager.prefix_hits > 0, "no prefix-cache hit happened"
        assert max(map(len, prompts)) > 64  # so prefills were chunked
        assert engine.kv_manager.pool.num_used_blocks == 0
    finally:
        llm.engine.shutdown()


def test_each_rank_holds_half_the_weights_and_half_the_kv_heads(tp_models):
    path = tp_models["llama"]  # untied LM head, 2 KV heads: everything splits
    budget = 64 << 10
    whole = LLM(path, dtype="float32", kv_cache_memory=budget)
    whole_bytes = parameter_bytes(whole.engine.model)
    whole_blocks = whole.engine.kv_cache.num_blocks
    del whole
    llm = LLM(path, dtype="float32", kv_cache_memory=budget, tensor_parallel_size=TP,
              num_threads=1)
    try:
        per_rank = {0: parameter_bytes(llm.engine.model), **llm.engine.workers.worker_param_bytes}
        assert sorted(per_rank) == list(range(TP))
        for rank, nbytes in per_rank.items():  # only the norms are replicated
            assert 0.49 < nbytes / whole_bytes < 0.51, (rank, nbytes, whole_bytes)
        # the same KV budget per rank holds twice the blocks: each rank has 1 of 2 KV heads
        assert llm.engine.model.num_kv_heads_per_rank == 1
        assert llm.engine.kv_cache.num_blocks >= 2 * whole_blocks
        print(f"parameter bytes: whole {whole_bytes}, per rank {per_rank}")
    finally:
        llm.engine.shutdown()
