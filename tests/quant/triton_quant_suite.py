"""The Triton int8/int4 matmul against dequantize-then-matmul, in Triton's CPU interpreter.

Not collected on its own (no test_ prefix): test_triton_quant.py runs it in a child process
with TRITON_INTERPRET=1 (see tests/runtime/triton_interpreter_suite.py for why). bf16 tl.dot
is wrong in the interpreter, so the cases use fp32 and fp16.
"""

from __future__ import annotations

import os

# CI: the interpreter on CPU tensors; QUIRE_TRITON_DEVICE=cuda: compiled on a GPU.
DEVICE_TYPE = os.environ.get("QUIRE_TRITON_DEVICE", "cpu")
if DEVICE_TYPE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module in a fresh process with TRITON_INTERPRET=1 "
                       "(see tests/quant/test_triton_quant.py), or on a GPU with "
                       "QUIRE_TRITON_DEVICE=cuda")

import pytest  # noqa: E402
import torch  # noqa: E402

from quire.layers import quant_formats as qf  # noqa: E402
from quire.layers.triton_quant import quant_matmul  # noqa: E402

from quant_helpers import matmul_error_bound  # noqa: E402


@pytest.mark.parametrize("kind,group", [("int8", None), ("int8", 16), ("int4", 32),
                                        ("int4", 64)])
@pytest.mark.parametrize("dtype,fast", [(torch.float32, False), (torch.float16, False),
                                        (torch.float16, True)])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_triton_matches_dequantize_then_matmul(kind, group, dtype, fast, m):
    torch.manual_seed(m)
    n, k = 72, 128
    w = torch.randn(n, k)
    if kind == "int8":
        q, s = qf.quantize_int8(w, group)
        z, dense = None, qf.dequantize_int8(q, s)
    else:
        q, s, z = qf.quantize_int4(w, group)
        dense = qf.dequantize_int4(q, s, z)
    x = torch.randn(m, k).to(dtype)
    on = [t.to(DEVICE_TYPE) if t is not None else None for t in (x, q, s, z)]
    got = quant_matmul(*on, fast=fast).cpu()
    assert got.dtype == dtype and got.shape == (m, n)
    want = x.float() @ dense.T
    # fast: each weight rounded to fp16 before the product (one fp16 ulp, 2^-11, each)
    bound = matmul_error_bound(x.float(), dense, dtype, weight_rounding=2.0 ** -11 if fast
                               else 0.0)
    assert ((got.float() - want).abs() <= bound).all()
