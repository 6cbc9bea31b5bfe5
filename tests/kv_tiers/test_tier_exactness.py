"""Greedy output with tier hits equals transformers' (float32) on two tiny random families,
with chunked prefill, preemption, cache_salt and a LoRA adapter in the mix, and no KV block
is left in use. The pool is small enough that the second round's prefixes are long gone
from it: what it does not recompute comes from the host and disk tiers."""

from __future__ import annotations

import pytest
from tier_helpers import (
    MAX_NEW_TOKENS,
    assert_no_blocks_in_use,
    evict_with,
    generate,
    prompt,
    tier_stats,
    tiny_llm,
)

from quire.lora.request import LoRARequest

from lora_helpers import merged_reference_model, save_random_adapter
from runtime_helpers import hf_greedy, hf_model

SHARED = prompt(7, 96)  # a 6-block system prompt that most requests start with
PROMPTS = [SHARED + prompt(10 + i, n) for i, n in enumerate((20, 37, 50, 64))] + [
    prompt(20, 130), prompt(21, 75)]
SALTS = [None, "tenant-a", None, "tenant-b", None, "tenant-a"]


def _tiered_llm(path, config, tmp_path, **kw):
    # 24 blocks for six prompts of 8-10 blocks each: chunks of 32 tokens, and preemption
    return tiny_llm(path, config, 24, max_num_batched_tokens=32,
                    kv_offloading_size=0.01, kv_offloading_disk_path=str(tmp_path / "kv"),
                    kv_offloading_disk_size=0.01, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_outputs_with_tier_hits_equal_transformers(family, tiny_models, tmp_path):
    path, config = tiny_models[family]
    reference = hf_greedy(hf_model(path), PROMPTS, MAX_NEW_TOKENS)
    llm = _tiered_llm(path, config, tmp_path)
    try:
        first = generate(llm, PROMPTS, cache_salt=SALTS)
        assert [o.outputs[0].token_ids for o in first] == reference
        evict_with(llm, [prompt(30 + i, 300) for i in range(2)])
        again = generate(llm, PROMPTS, cache_salt=SALTS)
        assert [o.outputs[0].token_ids for o in again] == reference
        assert sum(o.num_cached_tokens for o in again) >= 6 * 16 * len(PROMPTS)
        # the salted tenants never got the unsalted prefix, in the pool or in a tier
        salted = generate(llm, [PROMPTS[4]], cache_salt="tenant-new")[0]
        assert salted.num_cached_tokens == 0
        assert salted.outputs[0].token_ids == reference[4]
        assert tier_stats(llm, "host").hits > 0
        assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
        assert_no_blocks_in_use(llm)
    finally:
        llm.engine.shutdown()


def test_lora_blocks_stay_in_the_host_tier(tiny_models, tmp_path):
    """An adapter's hash chain is seeded with an engine-local key, so its blocks go to the
    host tier only, never to disk where another process could read them."""
    path, config = tiny_models["llama"]
    adapter = save_random_adapter(path, str(tmp_path / "adapter"), r=8, seed=3, std=0.06)
    lora = LoRARequest("a", 1, adapter)
    prompts = PROMPTS[:3]
    base_ref = hf_greedy(hf_model(path), prompts, MAX_NEW_TOKENS)
    lora_ref = hf_greedy(merged_reference_model(path, adapter), prompts, MAX_NEW_TOKENS)
    llm = _tiered_llm(path, config, tmp_path, enable_lora=True, max_lora_rank=8)
    try:
        for _ in range(2):
            outs = generate(llm, prompts + prompts, lora_request=[lora] * 3 + [None] * 3)
            assert [o.outputs[0].token_ids for o in outs] == lora_ref + base_ref
            llm.engine.kv_tiers.flush()
            evict_with(llm, [prompt(40 + i, 300) for i in range(2)])
        llm.engine.kv_tiers.flush()
        assert tier_stats(llm, "host").hits > 0
        on_disk = {p.stem for p in (tmp_path / "kv").rglob("*.kv")}
        lora_keys = {h.hex() for h in _hashes(llm, prompts[0], lora=True)}
        assert on_disk and not on_disk & lora_keys
        assert_no_blocks_in_use(llm)
    finally:
        llm.engine.shutdown()


def _hashes(llm, p, lora):
    from quire.engine.block_hash import ExtraKeys, extend_block_hashes
    key = llm.engine.lora.registry.get("a").key if lora else None
    out = []
    extend_block_hashes(out, p, 16, (len(p) - 1) // 16, ExtraKeys(adapter=key))
    return out
