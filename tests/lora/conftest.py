"""LoRA test fixtures: one tiny random Llama, two random PEFT adapters on it, and transformers
+ PEFT (merged) greedy references. Helpers live in lora_helpers.py."""

from __future__ import annotations

import pytest

from lora_helpers import (
    MAX_NEW_TOKENS,
    hf_greedy,
    hf_model,
    merged_reference_model,
    random_prompts,
    save_random_adapter,
    save_tiny_model,
    smollm2_tokenizer,
    tiny_config,
)

PROMPT_LENGTHS = [1, 7, 16, 17, 40, 100]   # across block (16) and chunk (32) boundaries


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_base")
    return save_tiny_model(str(root / "llama"), tiny_config("llama"), smollm2_tokenizer())


@pytest.fixture(scope="session")
def adapters(tiny_llama, tmp_path_factory):
    """name -> PEFT folder. 'a': rank 16 (= max_lora_rank in the tests) on all seven
    targets. 'b': rank 4 with per-module rank_pattern / alpha_pattern and rslora, on four."""
    root = tmp_path_factory.mktemp("lora_adapters")
    return {
        "a": save_random_adapter(tiny_llama, str(root / "a"), r=16, lora_alpha=8, seed=1,
                                 std=0.06),
        "b": save_random_adapter(tiny_llama, str(root / "b"), r=4, lora_alpha=6, seed=2,
                                 std=0.08, targets=["q_proj", "v_proj", "o_proj", "down_proj"],
                                 use_rslora=True, rank_pattern={"down_proj": 8},
                                 alpha_pattern={"v_proj": 3}),
    }


@pytest.fixture(scope="session")
def prompts():
    return random_prompts(lengths=PROMPT_LENGTHS, seed=7)


@pytest.fixture(scope="session")
def references(tiny_llama, adapters, prompts):
    """None (base) / adapter name -> transformers' greedy outputs per prompt; the adapters'
    from PEFT's merge_and_unload on the same weights."""
    models = {None: hf_model(tiny_llama)}
    models.update({n: merged_reference_model(tiny_llama, p) for n, p in adapters.items()})
    return {n: hf_greedy(m, prompts, MAX_NEW_TOKENS) for n, m in models.items()}
