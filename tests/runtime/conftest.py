"""Runtime test fixtures. The helpers they use live in runtime_helpers.py, imported by name
(pyproject's pytest `pythonpath`); nothing imports a conftest module."""

from __future__ import annotations

import pytest

from runtime_helpers import (
    MODEL_FAMILIES,
    SMOLLM_MAX_NEW_TOKENS,
    SMOLLM_PROMPTS,
    TINY_MAX_NEW_TOKENS,
    hf_greedy,
    hf_model,
    random_prompts,
    save_tiny_model,
    smollm2_hf_greedy,
    smollm2_hf_model,
    smollm2_tokenizer,
    tiny_config,
)


@pytest.fixture(scope="session")
def smollm_tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm_tokenizer):
    """family -> folder of a tiny random model (safetensors + the SmolLM2 tokenizer)."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: save_tiny_model(str(root / f), tiny_config(f), smollm_tokenizer)
            for f in MODEL_FAMILIES}


@pytest.fixture(scope="session")
def tiny_references(tiny_models):
    """family -> (prompts, transformers' greedy outputs)."""
    prompts = random_prompts()
    return {f: (prompts, hf_greedy(hf_model(path), prompts, TINY_MAX_NEW_TOKENS))
            for f, path in tiny_models.items()}


@pytest.fixture(scope="session")
def hf_smollm():
    return smollm2_hf_model()


@pytest.fixture(scope="session")
def smollm_reference(smollm_tokenizer):
    """(prompt token ids, transformers' greedy outputs) for SmolLM2."""
    prompts = [smollm_tokenizer(p).input_ids for p in SMOLLM_PROMPTS]
    assert min(map(len, prompts)) == 1 and max(map(len, prompts)) <= 300
    return prompts, smollm2_hf_greedy(prompts, SMOLLM_MAX_NEW_TOKENS)


@pytest.fixture(scope="session")
def smollm():
    """One float32 SmolLM2 engine shared by the tests that only read outputs."""
    from quire import LLM
    return LLM(dtype="float32", kv_cache_memory=64 << 20)
