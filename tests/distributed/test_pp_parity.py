"""Pipeline parallelism on CPU over gloo: two stages, and two stages of two tensor ranks each,
give transformers' float32 greedy output token for token for three families (a plain one,
one whose layers keep their own residual stream, and a mixture of experts), with chunked
prefill, prefix-cache hits and preemption in the same run; micro-batches cut the steps; each
stage holds only its layers and their KV cache."""

from __future__ import annotations

import pytest
import torch

from quire import LLM, SamplingParams
from quire.worker.model_builder import parameter_bytes

from tp_helpers import assert_two_ranks_match_transformers, moe_helpers, shared_prefix_prompts
from tp_helpers import runtime_helpers as rh

MAX_TOKENS = 16

_prompts = shared_prefix_prompts


def _model(family: str, tmp_path, tokenizer):
    if family in moe_helpers.MOE_FAMILIES:
        cfg = moe_helpers.tiny_moe_config(family)
        return moe_helpers.save_tiny_moe(str(tmp_path / family), cfg, tokenizer), cfg
    cfg = rh.tiny_config(family)
    return rh.save_tiny_model(str(tmp_path / family), cfg, tokenizer), cfg


def _micro_batched(engine):
    """The steps were cut into micro-batches: the stages had two in flight."""
    runner = engine.executor.runner
    assert runner.micro_batches == 2
    assert runner.pipeline is not None and runner.pipeline.num_stages == 2


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2xpp2"])
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_moe"])
def test_pipeline_stages_match_transformers_with_chunks_prefix_hits_and_preemption(
        family, tp, tmp_path, smollm_tokenizer):
    path, cfg = _model(family, tmp_path, smollm_tokenizer)
    assert_two_ranks_match_transformers(path, cfg, _prompts(), MAX_TOKENS, _micro_batched,
                                        tp=tp, pp=2)


def test_pipeline_stages_verify_speculative_proposals(tp_models):
    """n-gram speculation through two stages: the verification rows are decodes of the
    micro-batches; the same greedy tokens, with proposals accepted."""
    from transformers import AutoConfig
    path = tp_models["llama"]

    def accepted(engine):
        assert engine.speculator.counters.num_accepted_tokens > 0
    prompts = _prompts()
    assert_two_ranks_match_transformers(
        path, AutoConfig.from_pretrained(path), prompts + [p + p for p in prompts[:4]],
        MAX_TOKENS, accepted, tp=1, pp=2, speculative_config={
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3})


def test_each_stage_holds_its_layers_and_their_kv_cache(tmp_path, smollm_tokenizer):
    """Six layers over two stages (3 + 3, and '2,4' by the override): rank 0 holds the
    embedding and its layers only, and the same KV budget holds blocks for its layers only."""
    cfg = rh.tiny_config("llama", num_hidden_layers=6)
    path = rh.save_tiny_model(str(tmp_path / "six"), cfg, smollm_tokenizer)
    budget = 96 << 10
    whole = LLM(path, dtype="float32", kv_cache_memory=budget)
    whole_blocks = whole.engine.executor.kv_cache.num_blocks
    whole_layer_bytes = parameter_bytes(whole.engine.executor.model.layers[0])
    del whole
    for partition, first in ((None, 3), ("2,4", 2)):
        llm = LLM(path, dtype="float32", kv_cache_memory=budget, pipeline_parallel_size=2,
                  pipeline_layer_partition=partition, num_threads=1)
        try:
            executor = llm.engine.executor
            model = executor.model
            assert list(model.stage_layers) == list(range(first))
            assert model.lm_head is None and model.norm is None  # the last stage's
            assert model.embed_tokens is not None
            assert len(executor.kv_cache.layers) == first
            assert executor.kv_cache.num_blocks == budget // executor._bytes_per_block()
            assert executor.kv_cache.num_blocks >= whole_blocks * 6 // first - 1
            held = sum(parameter_bytes(model.layers[i]) for i in model.stage_layers)
            assert held == first * whole_layer_bytes
            [worker_bytes] = executor.workers.worker_param_bytes.values()
            assert worker_bytes > (6 - first) * whole_layer_bytes  # + the norm and LM head
        finally:
            llm.engine.shutdown()


def test_prompt_logprobs_and_embeddings_come_back_through_the_stages(tp_models):
    """The rows rank 0 gets back from the last stage: scored prompt positions (their chunks
    are never cut between micro-batches) and pooled hidden states, the single process's
    (the same greedy tokens; logprobs and vectors up to the float sums' order, since the
    micro-batches are other matmul shapes)."""
    path = tp_models["llama"]
    prompts = rh.random_prompts(4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=1)
    texts = ["hello world", "a b c " * 30]
    results = []
    for pp in (1, 2):
        llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=64,
                  pipeline_parallel_size=pp, num_threads=1)
        try:
            results.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.engine.shutdown()
        pooled = LLM(path, dtype="float32", runner="pooling", convert="embed",
                     kv_cache_memory=4 << 20, pipeline_parallel_size=pp, num_threads=1)
        try:
            results.append(torch.tensor([o.outputs.embedding for o in pooled.embed(texts)]))
        finally:
            pooled.engine.shutdown()
    single, single_vectors, staged, staged_vectors = results
    for a, b in zip(single, staged):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)
    torch.testing.assert_close(staged_vectors, single_vectors, atol=1e-5, rtol=0)


def test_a_draft_model_on_rank_0_proposes_for_the_stages(tp_models):
    """Draft-model speculation: the draft (its own whole model and KV cache) runs on rank 0,
    the stages verify; transformers' greedy tokens, with proposals accepted."""
    path = tp_models["llama"]
    prompts = [p + p for p in rh.random_prompts(4, seed=5)]
    expected = rh.hf_greedy(rh.hf_model(path), prompts, MAX_TOKENS)
    llm = LLM(path, dtype="float32", kv_cache_memory=4 << 20, pipeline_parallel_size=2,
              num_threads=1, speculative_config={"model": path, "num_speculative_tokens": 3})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.engine.speculator.counters.num_accepted_tokens > 0
        assert llm.engine.kv_manager.pool.num_used_blocks == 0
    finally:
        llm.engine.shutdown()
