"""Quantization test fixtures (helpers in quant_helpers.py and tests/runtime's
runtime_helpers.py, imported by name)."""

from __future__ import annotations

import pytest

from runtime_helpers import save_tiny_model, smollm2_tokenizer, tiny_config


@pytest.fixture(scope="session")
def smollm_tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm_tokenizer):
    """A tiny random Llama (safetensors + the SmolLM2 tokenizer): 3 layers, GQA, K = 64/128,
    so every int4 group size (32/64/128 where it divides) is exercised."""
    root = tmp_path_factory.mktemp("tiny_quant")
    return save_tiny_model(str(root / "llama"), tiny_config("llama"), smollm_tokenizer)
