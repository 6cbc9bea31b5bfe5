"""Mixture-of-experts under tensor parallelism (two ranks over gloo): every expert's
intermediate size is split across the ranks, the down projection's partial sums meet in the
all-reduce, and the output is transformers' float32 greedy output token for token, with
chunked prefill, prefix-cache hits and preemption in the same run; each rank holds half of
every expert."""

from __future__ import annotations

import importlib.util

import pytest

from quire import LLM, SamplingParams
from quire.layers.fused_moe import FusedMoE

from tp_helpers import ROOT, TP, kv_budget_for
from tp_helpers import runtime_helpers as rh

MAX_TOKENS = 16

_spec = importlib.util.spec_from_file_location("moe_helpers",
                                               ROOT / "tests" / "runtime" / "moe_helpers.py")
moe_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe_helpers)


def _prompts():
    """Prompts of 1-300 tokens and two that share a long prefix with the longest."""
    prompts = rh.random_prompts(6, lengths=[1, 17, 64, 150, 257, 300], seed=7)
    return prompts + [prompts[-1][:200] + [11, 12, 13], list(prompts[-1])]


@pytest.mark.parametrize("family", moe_helpers.MOE_FAMILIES)
def test_two_ranks_match_transformers_with_chunks_prefix_hits_and_preemption(
        family, tmp_path, smollm_tokenizer):
    cfg = moe_helpers.tiny_moe_config(family)
    path = moe_helpers.save_tiny_moe(str(tmp_path / family), cfg, smollm_tokenizer)
    prompts = _prompts()
    expected = rh.hf_greedy(rh.hf_model(path), prompts, MAX_TOKENS)

    need = -(-(max(map(len, prompts)) + MAX_TOKENS) // 16)  # blocks of the longest request
    llm = LLM(path, dtype="float32", tensor_parallel_size=TP, num_threads=1,
              kv_cache_memory=kv_budget_for(cfg, need + 4, TP),
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
        assert engine.kv_manager.pool.num_used_blocks == 0
        experts = next(m for m in engine.model.modules() if isinstance(m, FusedMoE))
        assert experts.intermediate_size == 32 // TP  # each rank: half of every expert
        assert experts.w13_weight.shape[0] == 8
    finally:
        llm.engine.shutdown()
