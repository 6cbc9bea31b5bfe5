"""The Triton FP8 dequantize kernel against torch's own float8_e4m3fn conversion, in Triton's
CPU interpreter (run by test_prequantized_kernels.py in a child process with
TRITON_INTERPRET=1; QUIRE_TRITON_DEVICE=cuda runs it compiled on a GPU)."""

from __future__ import annotations

import os

DEVICE_TYPE = os.environ.get("QUIRE_TRITON_DEVICE", "cpu")
if DEVICE_TYPE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module in a fresh process with TRITON_INTERPRET=1 "
                       "(see tests/quant/test_prequantized_kernels.py), or on a GPU with "
                       "QUIRE_TRITON_DEVICE=cuda")

import pytest  # noqa: E402
import torch  # noqa: E402

from quire.layers.prequantized import fp8, triton_fp8  # noqa: E402


def test_every_e4m3_byte_decodes_as_torch_does():
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    weight = codes.view(torch.float8_e4m3fn).reshape(2, -1).to(DEVICE_TYPE)
    scales = torch.ones(2, 1, device=DEVICE_TYPE)
    got = triton_fp8.dequantize(weight, scales)
    assert torch.equal(got.cpu(), weight.cpu().float())


@pytest.mark.parametrize("n,k,block,dtype", [(48, 256, 128, torch.float32),
                                             (33, 200, 200, torch.float32),
                                             (64, 384, 128, torch.float16)])
def test_dequantize_matches_the_reference(n, k, block, dtype):
    w = (torch.randn(n, k) * 50).clamp(-448, 448).to(fp8.FP8_DTYPE)
    scales = torch.rand(n, -(-k // block)) + 0.01
    want = fp8.dequantize(w, scales, dtype)
    got = triton_fp8.dequantize(w.to(DEVICE_TYPE), scales.to(DEVICE_TYPE), dtype)
    assert torch.equal(got.cpu(), want)
