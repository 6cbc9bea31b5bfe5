"""The LoRA Triton kernels against the torch path in Triton's interpreter, in a child
process (see triton_interpreter_suite.py for why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SUITE = Path(__file__).with_name("triton_interpreter_suite.py")
REPO = Path(__file__).resolve().parents[2]


def test_lora_kernels_match_torch_in_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider",
         f"--basetemp={tmp_path / 'suite'}", "--durations=5"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(child.stdout[-4000:])
    assert child.returncode == 0, f"interpreter suite failed:\n{child.stdout[-12000:]}\n" \
                                  f"{child.stderr[-3000:]}"
