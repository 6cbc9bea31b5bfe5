"""Multimodal fixtures: one tiny random LLaVA and one tiny random Qwen2.5-VL folder (config,
weights, processor) per session, and transformers' model and processor on each (the
oracles). Helpers live in mm_helpers.py and qwen_vl_helpers.py."""

from __future__ import annotations

import pytest

from mm_helpers import hf_llava, save_tiny_llava
from qwen_vl_helpers import hf_qwen_vl, save_tiny_qwen_vl


@pytest.fixture(scope="session")
def llava_path(tmp_path_factory):
    return save_tiny_llava(str(tmp_path_factory.mktemp("llava") / "tiny-llava"))


@pytest.fixture(scope="session")
def hf_oracle(llava_path):
    from transformers import AutoProcessor
    return hf_llava(llava_path), AutoProcessor.from_pretrained(llava_path)


@pytest.fixture(scope="session")
def qwen_vl_path(tmp_path_factory):
    return save_tiny_qwen_vl(str(tmp_path_factory.mktemp("qwen-vl") / "tiny-qwen2.5-vl"))


@pytest.fixture(scope="session")
def qwen_vl_oracle(qwen_vl_path):
    from transformers import AutoProcessor
    return hf_qwen_vl(qwen_vl_path), AutoProcessor.from_pretrained(qwen_vl_path)
