"""Tensor parallelism on CPU with gloo: two ranks give transformers' float32 greedy output
token for token, with chunked prefill, prefix caching and preemption in the same run; and
each rank holds half the weights."""

from __future__ import annotations

import pytest

from quire import LLM
from quire.worker.model_builder import parameter_bytes

from tp_helpers import FAMILIES, TP, assert_two_ranks_match_transformers
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
    assert_two_ranks_match_transformers(path, AutoConfig.from_pretrained(path), _prompts(),
                                        MAX_TOKENS)


def test_two_ranks_verify_speculative_proposals(tp_models):
    """n-gram speculation under tensor parallelism: the workers run the verification rows like
    decodes, rank 0 verifies; the same greedy tokens, with proposals accepted."""
    from transformers import AutoConfig
    path = tp_models["llama"]

    def accepted(engine):
        assert engine.speculator.counters.num_accepted_tokens > 0
    prompts = _prompts()
    assert_two_ranks_match_transformers(
        path, AutoConfig.from_pretrained(path), prompts + [p + p for p in prompts[:4]],
        MAX_TOKENS, accepted, speculative_config={
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3})


def test_each_rank_holds_half_the_weights_and_half_the_kv_heads(tp_models):
    path = tp_models["llama"]  # untied LM head, 2 KV heads: everything splits
    budget = 64 << 10
    whole = LLM(path, dtype="float32", kv_cache_memory=budget)
    whole_bytes = parameter_bytes(whole.engine.executor.model)
    whole_blocks = whole.engine.executor.kv_cache.num_blocks
    del whole
    llm = LLM(path, dtype="float32", kv_cache_memory=budget, tensor_parallel_size=TP,
              num_threads=1)
    try:
        per_rank = {0: parameter_bytes(llm.engine.executor.model), **llm.engine.executor.workers.worker_param_bytes}
        assert sorted(per_rank) == list(range(TP))
        for rank, nbytes in per_rank.items():  # only the norms are replicated
            assert 0.49 < nbytes / whole_bytes < 0.51, (rank, nbytes, whole_bytes)
        # the same KV budget per rank holds twice the blocks: each rank has 1 of 2 KV heads
        assert llm.engine.executor.model.num_kv_heads_per_rank == 1
        assert llm.engine.executor.kv_cache.num_blocks >= 2 * whole_blocks
        print(f"parameter bytes: whole {whole_bytes}, per rank {per_rank}")
    finally:
        llm.engine.shutdown()
