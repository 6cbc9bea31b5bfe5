"""The Triton int8/int4 kernels, run in the interpreter in a child process."""

from __future__ import annotations

from pathlib import Path

from runtime_helpers import run_triton_interpreter_suite


def test_triton_quant_kernels_in_the_interpreter(tmp_path):
    assert run_triton_interpreter_suite(Path(__file__).with_name("triton_quant_suite.py"), tmp_path) > 0
