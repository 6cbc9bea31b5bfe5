"""The Triton attention backend: choosing it, and its kernels checked against the torch
backend in Triton's CPU interpreter.

The kernel checks live in triton_interpreter_suite.py and run in a child pytest with
TRITON_INTERPRET=1. They can't run in this process: Triton decides between compiler and
interpreter for its own standard library (tl.max, tl.sum, ...) when triton is first
imported, and by the time this module runs in a full session torch._dynamo (imported by
transformers) has usually imported triton already, without the variable. A child process
also keeps TRITON_INTERPRET out of every other test's environment.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quire.attention.selector import attention_backend_class

from runtime_helpers import run_triton_interpreter_suite

SUITE = Path(__file__).with_name("triton_interpreter_suite.py")


def test_auto_picks_torch_on_cpu():
    assert attention_backend_class("auto", torch.device("cpu")).name == "torch"


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device"):
        attention_backend_class("triton", torch.device("cpu"))


def test_kernels_match_torch_backend_in_the_interpreter(tmp_path):
    """Cache write, paged decode (with context splits and their reduction) and prefill /
    extend kernels against the torch backend, then whole engine runs. Run the suite itself
    for per-case results and timings:
        TRITON_INTERPRET=1 python -m pytest tests/runtime/triton_interpreter_suite.py"""
    assert run_triton_interpreter_suite(SUITE, tmp_path) > 0
