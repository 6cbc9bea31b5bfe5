"""Multimodal fixtures: one tiny random LLaVA folder (config, weights, processor) per session,
and transformers' model and processor on it (the oracle). Helpers live in mm_helpers.py."""

from __future__ import annotations

import pytest

from mm_helpers import hf_llava, save_tiny_llava


@pytest.fixture(scope="session")
def llava_path(tmp_path_factory):
    return save_tiny_llava(str(tmp_path_factory.mktemp("llava") / "tiny-llava"))


@pytest.fixture(scope="session")
def hf_oracle(llava_path):
    from transformers import AutoProcessor
    return hf_llava(llava_path), AutoProcessor.from_pretrained(llava_path)
