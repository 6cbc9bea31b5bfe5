"""The Triton fused-MoE kernel against the per-expert loop, in Triton's CPU interpreter.

Not collected on its own (no test_ prefix): test_fused_moe.py runs it in a child process with
TRITON_INTERPRET=1. bf16 tl.dot is wrong in the interpreter, so the cases are fp32 and fp16;
QUIRE_TRITON_DEVICE=cuda runs the same cases compiled on a GPU.
"""

from __future__ import annotations

import os

DEVICE_TYPE = os.environ.get("QUIRE_TRITON_DEVICE", "cpu")
if DEVICE_TYPE != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this module in a fresh process with TRITON_INTERPRET=1 "
                       "(see tests/runtime/test_fused_moe.py), or on a GPU with "
                       "QUIRE_TRITON_DEVICE=cuda")

import pytest  # noqa: E402
import torch  # noqa: E402
from moe_helpers import random_moe, routed  # noqa: E402

from quire.layers.quantization import QuantizeOnLoadConfig  # noqa: E402


def _to_device(layer):
    return layer.to(DEVICE_TYPE)


# (activation with biases?, quantization, tokens, top_k): decode-sized and prefill-sized
# batches (several row-block sizes), top-1/2/4, every weight format
CASES = [("silu", None, 1, 2), ("silu", None, 37, 2), ("silu", None, 300, 2),
         ("swigluoai", None, 29, 2), ("silu", None, 40, 4), ("silu", None, 9, 1),
         ("silu", "int8", 33, 2), ("silu", "int4", 33, 2), ("swigluoai", "int4", 5, 2)]


@pytest.mark.parametrize("activation,quant,tokens,top_k", CASES)
def test_triton_equals_the_loop_in_float32(activation, quant, tokens, top_k):
    qc = QuantizeOnLoadConfig(quant, 32) if quant else None
    layer, _ = random_moe(num_experts=8, top_k=top_k, bias=activation == "swigluoai",
                          activation=activation, quant_config=qc, keep_canonical=True)
    x, logits = routed(tokens, 8)
    layer.impl = "loop"
    want = layer(x, logits)
    layer = _to_device(layer)
    layer.impl = "triton"
    got = layer(x.to(DEVICE_TYPE), logits.to(DEVICE_TYPE)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_triton_float16_is_close_to_the_loop(quant):
    """fp16 activations: tl.dot on fp16 tiles (weights dequantized to fp16 in registers)."""
    qc = QuantizeOnLoadConfig(quant, 32) if quant else None
    layer, _ = random_moe(num_experts=8, top_k=2, quant_config=qc, keep_canonical=True,
                          dtype=torch.float16)
    x, logits = routed(24, 8, dtype=torch.float16)
    layer.impl = "loop"
    want = layer.float()(x.float(), logits.float()) if quant is None else layer(x, logits)
    layer = _to_device(layer.half() if quant is None else layer)
    layer.impl = "triton"
    got = layer(x.to(DEVICE_TYPE), logits.to(DEVICE_TYPE)).cpu()
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
