"""Fixtures of the tensor-parallel tests (helpers: tp_helpers.py)."""

from __future__ import annotations

import os

import pytest

from tp_helpers import FAMILIES, wait_gone, worker_processes
from tp_helpers import runtime_helpers as rh


@pytest.fixture(scope="session")
def smollm_tokenizer():
    return rh.smollm2_tokenizer()


@pytest.fixture(scope="session")
def tp_models(tmp_path_factory, smollm_tokenizer):
    """family -> folder of a tiny random model (float32 safetensors)."""
    root = tmp_path_factory.mktemp("tp-tiny")
    return {f: rh.save_tiny_model(str(root / f), rh.tiny_config(f, **kw), smollm_tokenizer)
            for f, kw in FAMILIES.items()}


@pytest.fixture(autouse=True)
def no_workers_left_behind():
    """Every test ends with no worker process of this test process still running."""
    yield
    left = wait_gone(worker_processes(os.getpid()), timeout=30)
    assert not left, f"worker processes left behind: {left}"
