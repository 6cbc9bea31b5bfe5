"""The LoRA Triton kernels against the torch path in Triton's interpreter, in a child
process (see triton_interpreter_suite.py for why)."""

from __future__ import annotations

from pathlib import Path

from runtime_helpers import run_triton_interpreter_suite

SUITE = Path(__file__).with_name("triton_interpreter_suite.py")


def test_lora_kernels_match_torch_in_the_interpreter(tmp_path):
    assert run_triton_interpreter_suite(SUITE, tmp_path) > 0
