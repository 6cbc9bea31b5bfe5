"""The correctness oracle: float32 greedy output equals transformers' token for token, for
every family, whatever the batching, chunking or preemption."""

from __future__ import annotations

import pytest

from quire import LLM, SamplingParams
from quire.worker.kv_cache import bytes_per_block

from runtime_helpers import MODEL_FAMILIES, SMOLLM_MAX_NEW_TOKENS, TINY_MAX_NEW_TOKENS


def _blocks_budget(llm_cfg, num_blocks: int, block_size: int = 16) -> int:
    import torch
    return num_blocks * bytes_per_block(llm_cfg.num_hidden_layers, block_size,
                                        llm_cfg.num_key_value_heads,
                                        llm_cfg.hidden_size // llm_cfg.num_attention_heads
                                        if not getattr(llm_cfg, "head_dim", None)
                                        else llm_cfg.head_dim, torch.float32)


# setting -> engine keywords, given the number of KV blocks the longest request needs
SETTINGS = {
    "default": lambda need: {},
    "chunked": lambda need: {"max_num_batched_tokens": 48},
    "preempt": lambda need: {"num_blocks": need + 2, "max_num_batched_tokens": 512},
}


def _run(path, prompts, max_tokens, setting, hf_config):
    need = -(-(max(map(len, prompts)) + max_tokens) // 16)
    kw = SETTINGS[setting](need)
    blocks = kw.pop("num_blocks", 400)
    llm = LLM(path, dtype="float32", kv_cache_memory=_blocks_budget(hf_config, blocks), **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens),
                        use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_tiny_models_match_transformers(family, setting, tiny_models, tiny_references):
    from transformers import AutoConfig
    prompts, expected = tiny_references[family]
    hf_config = AutoConfig.from_pretrained(tiny_models[family])
    llm, got = _run(tiny_models[family], prompts, TINY_MAX_NEW_TOKENS, setting, hf_config)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) diverges at token " \
                       f"{next(j for j, (a, b) in enumerate(zip(g + [-1], e + [-2])) if a != b)}"
    if setting == "preempt":
        assert llm.engine.scheduler.num_preemptions["recompute"] > 0
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_smollm2_matches_transformers(setting, smollm_reference):
    from transformers import LlamaConfig
    prompts, expected = smollm_reference
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=30)
    llm, got = _run(None, prompts, SMOLLM_MAX_NEW_TOKENS, setting, cfg)
    assert got == expected
    if setting == "preempt":
        assert llm.engine.scheduler.num_preemptions["recompute"] > 0
    assert llm.engine.kv_manager.pool.num_used_blocks == 0
