"""Multimodal fixtures: one tiny random LLaVA, Qwen2.5-VL and Gemma 3 folder each (config,
weights, processor) per session, and transformers' model and processor on each (the
oracles). Helpers live in mm_helpers.py, qwen_vl_helpers.py and gemma3_helpers.py."""

from __future__ import annotations

import pytest

from gemma3_helpers import hf_gemma3, save_tiny_gemma3
from mm_helpers import hf_llava, save_tiny_llava
from qwen_vl_helpers import hf_qwen_vl, qwen_vl_processor, save_tiny_qwen_vl


@pytest.fixture(scope="session")
def llava_path(tmp_path_factory):
    return save_tiny_llava(str(tmp_path_factory.mktemp("llava") / "tiny-llava"))


@pytest.fixture(scope="session")
def hf_oracle(llava_path):
    from transformers import AutoProcessor
    return hf_llava(llava_path), AutoProcessor.from_pretrained(llava_path)


@pytest.fixture(scope="session")
def gemma3_path(tmp_path_factory):
    return save_tiny_gemma3(str(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3"))


@pytest.fixture(scope="session")
def gemma3_oracle(gemma3_path):
    from transformers import AutoProcessor
    return hf_gemma3(gemma3_path), AutoProcessor.from_pretrained(gemma3_path)


@pytest.fixture(scope="session")
def qwen_vl_path(tmp_path_factory):
    return save_tiny_qwen_vl(str(tmp_path_factory.mktemp("qwen-vl") / "tiny-qwen2.5-vl"))


@pytest.fixture(scope="session")
def qwen_vl_oracle(qwen_vl_path):
    return hf_qwen_vl(qwen_vl_path), qwen_vl_processor(qwen_vl_path)
