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


def test_mixed_sliding_and_full_layers_match_transformers(tmp_path, smollm_tokenizer):
    """Qwen2 with sliding-window layers above max_window_layers: two attention backends (one
    per window) share each step, and each must use its own masks."""
    from runtime_helpers import hf_greedy, hf_model, random_prompts, save_tiny_model, tiny_config
    cfg = tiny_config("qwen2", use_sliding_window=True, sliding_window=40, max_window_layers=1)
    assert set(cfg.layer_types) == {"full_attention", "sliding_attention"}
    path = save_tiny_model(str(tmp_path / "qwen2-swa"), cfg, smollm_tokenizer)
    prompts = random_prompts(6, lengths=[3, 39, 41, 90, 160, 300], seed=21)
    expected = hf_greedy(hf_model(path), prompts, 24)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=64)
    got = [o.outputs[0].token_ids for o in
           llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)]
    assert got == expected
    assert len(llm.engine.executor.model.backends) == 2


def test_smollm2_requests_sharing_a_system_prompt_match_transformers(smollm_tokenizer):
    """Ten requests behind two cached system prompts (~180 tokens, 11 blocks each) that open
    with the same sentence (the chat header and it fill the first block): their decode rows
    share those blocks, which the AVX2 build (and from 24 shared blocks the AVX-512 builds)
    reads once per group of rows sharing a system prompt (cascade decode: tiles of rows, merged with each row's tail by log-sum-exp; the
    groups split where the two prompts part). Greedy output still equals transformers',
    request by request."""
    from runtime_helpers import smollm2_hf_greedy
    opening = ("You are a careful assistant. Answer in one short sentence, name your sources "
               "when you can, and say so when you do not know. ")
    systems = [opening + ("Keep units, numbers and names exactly as the user wrote them, and "
                          "never invent a citation. " + opening) * 3,
               opening + ("Prefer plain words to jargon, give metric units first, and end "
                          "every answer with a full stop. " + opening) * 3]
    questions = ["What is the capital of France?", "Name a prime number above 10.",
                 "Which planet is the largest?", "What colour is the sky on a clear day?",
                 "How many legs does a spider have?", "What is water made of?"]
    chats = [(systems[0], q) for q in questions] + [(systems[1], q) for q in questions[:4]]
    prompts = [smollm_tokenizer.apply_chat_template(
        [{"role": "system", "content": s}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=True) for s, q in chats]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    assert min(map(len, prompts)) > 9 * 16
    assert prompts[0][:16] == prompts[-1][:16] and prompts[0][:9 * 16] != prompts[-1][:9 * 16]
    want = smollm2_hf_greedy(prompts, SMOLLM_MAX_NEW_TOKENS)
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=SMOLLM_MAX_NEW_TOKENS)
    # caches the system prompts' blocks
    llm.generate([prompts[0], prompts[-1]], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # chat answers, not an end of turn at once: each group decodes side by side for a while
    assert sorted(map(len, got[:6]))[-4] >= 8 and sorted(map(len, got[6:]))[-4] >= 8, \
        [len(g) for g in got]
    assert llm.engine.kv_manager.prefix_hits >= 8 * 9 * 16
    assert llm.engine.kv_manager.pool.num_used_blocks == 0
