"""KV-tier test fixtures: two tiny random model families (safetensors + SmolLM2's tokenizer)
and a real redis-server per test that asks for one. Helpers live in tier_helpers.py."""

from __future__ import annotations

import pytest
from tier_helpers import running_redis

from runtime_helpers import save_tiny_model, smollm2_tokenizer, tiny_config

FAMILIES = ("llama", "qwen2")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> (folder, its transformers config)."""
    root = tmp_path_factory.mktemp("tiers")
    out = {}
    for family in FAMILIES:
        config = tiny_config(family)
        out[family] = (save_tiny_model(str(root / family), config, smollm2_tokenizer()), config)
    return out


@pytest.fixture
def redis_server():
    with running_redis() as server:
        yield server
