"""Mixture-of-experts under tensor parallelism (two ranks over gloo): every expert's
intermediate size is split across the ranks, the down projection's partial sums meet in the
all-reduce, and the output is transformers' float32 greedy output token for token, with
chunked prefill, prefix-cache hits and preemption in the same run; each rank holds half of
every expert."""

from __future__ import annotations

import pytest

from quire.layers.fused_moe import FusedMoE

from tp_helpers import TP, assert_two_ranks_match_transformers, moe_helpers, shared_prefix_prompts

MAX_TOKENS = 16

_prompts = shared_prefix_prompts


@pytest.mark.parametrize("family", moe_helpers.MOE_FAMILIES)
def test_two_ranks_match_transformers_with_chunks_prefix_hits_and_preemption(
        family, tmp_path, smollm_tokenizer):
    cfg = moe_helpers.tiny_moe_config(family)
    path = moe_helpers.save_tiny_moe(str(tmp_path / family), cfg, smollm_tokenizer)

    def each_rank_holds_half_of_every_expert(engine):
        experts = next(m for m in engine.executor.model.modules() if isinstance(m, FusedMoE))
        assert experts.intermediate_size == 32 // TP
        assert experts.w13_weight.shape[0] == 8

    assert_two_ranks_match_transformers(path, cfg, _prompts(), MAX_TOKENS,
                                        each_rank_holds_half_of_every_expert)
