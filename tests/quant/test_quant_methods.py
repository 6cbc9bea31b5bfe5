"""Each quantized linear computes x @ dequant(W).T: the kernels against dequantize-then-matmul
within the fp32 reordering bound (quant_helpers.matmul_error_bound), and the formats round-trip
a float weight within their quantization step."""

from __future__ import annotations

import pytest
import torch

from quire.layers import quant_formats as qf
from quire.layers import quant_kernels
from quire.layers.quantization import Int4LinearMethod, Int8LinearMethod, QuantizeOnLoadConfig

from quant_helpers import matmul_error_bound


def _weights(kind, group, n=96, k=256, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(n, k) * 0.05
    if kind == "int8":
        q, s = qf.quantize_int8(w, group)
        return w, (q, s), qf.dequantize_int8(q, s)
    q, s, z = qf.quantize_int4(w, group)
    return w, (q, s, z), qf.dequantize_int4(q, s, z)


def test_nibbles_pack_even_k_low():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = qf.pack_nibbles(q)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(qf.unpack_nibbles(packed), q)


@pytest.mark.parametrize("kind,group", [("int8", None), ("int8", 32), ("int4", 32),
                                        ("int4", 64), ("int4", 128)])
def test_quantize_round_trip_within_half_a_step(kind, group):
    w, tensors, dense = _weights(kind, group)
    scales = tensors[1]
    g = group or w.shape[1]
    step = scales.repeat_interleave(g, dim=1)
    # round to nearest: |w - dequant| <= step / 2 (plus fp32 rounding of the arithmetic)
    assert ((w - dense).abs() <= step * (0.5 + 1e-5) + 1e-7).all()
    if kind == "int4":  # each group's min and max are hit exactly (q = 0 and q = 15)
        assert torch.allclose(dense.reshape(96, -1, g).amin(-1), w.reshape(96, -1, g).amin(-1),
                              atol=1e-6)


def _kernels(kind, tensors):
    """Every kernel that runs here for this format, by name."""
    out = {}
    for prefer in ("dequant", "torch", "native"):
        make = quant_kernels.int8_kernel if kind == "int8" else quant_kernels.int4_kernel
        kernel = make(*tensors, exact=prefer != "torch", prefer=prefer)
        out[kernel.name] = kernel
    return out


@pytest.mark.parametrize("kind,group", [("int8", None), ("int8", 32), ("int4", 32),
                                        ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 8, 33])
def test_every_kernel_equals_dequantize_then_matmul(kind, group, dtype, m):
    _, tensors, dense = _weights(kind, group)
    kernels = _kernels(kind, tensors)
    assert "dequant" in kernels
    if group is None or kind == "int4":
        assert kernels.keys() & {"torch-int8", "torch-int4"}  # torch's ops run on this CPU
    x = torch.randn(m, dense.shape[1]).to(dtype)
    want = x.float() @ dense.T
    for name, kernel in kernels.items():
        got = kernel(x)
        assert got.dtype == dtype and got.shape == want.shape, name
        # torch's ops take the scales (and zeros) in the activation dtype: in bf16 each is
        # rounded by up to 2^-9 relative; for int4 the zero's rounding is relative to the
        # zero, which is at most ~8 scales: allow 2^-9 * 16 of the magnitude
        rounding = 0.0
        if name.startswith("torch") and dtype == torch.bfloat16:
            rounding = 2.0 ** -9 * (16 if kind == "int4" else 1)
        bound = matmul_error_bound(x.float(), dense, dtype, rounding)
        if name.startswith("torch") and kind == "int4":  # zeros scale with |w| sums too
            bound = bound + rounding * (x.abs().double() @ dense.abs().double().T)
        assert ((got.float() - want).abs() <= bound).all(), name


def test_gguf_values_never_take_torch_ops_rounded_scales():
    """exact=True (a checkpoint's own values) refuses the ops whose scales are bf16."""
    _, tensors, _ = _weights("int8", None)
    assert quant_kernels.int8_kernel(*tensors, exact=True, prefer="torch").name == "dequant"
    _, tensors, _ = _weights("int4", 32)
    assert quant_kernels.int4_kernel(*tensors, exact=True, prefer="torch").name == "dequant"


class _Layer(torch.nn.Module):
    prefix = "layers.0.test"


@pytest.mark.parametrize("method", [Int8LinearMethod(None, from_float=True, exact=False),
                                    Int4LinearMethod(32, from_float=True, exact=False)])
def test_quantize_on_load_method_replaces_the_float_weight(method):
    layer = _Layer()
    method.create_weights(layer, 64, 48, torch.float32)
    layer.weight.data.copy_(torch.randn(48, 64))
    method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight") and layer.qweight.dtype in (torch.int8, torch.uint8)
    x = torch.randn(3, 64)
    want = x @ method.dequantized(layer).T
    got = method.apply(layer, x, None)
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_group_that_does_not_divide_the_input_is_refused_by_name():
    layer = _Layer()
    with pytest.raises(ValueError, match=r"layers.0.test.*group size 64 must divide.*96.*"
                                         r"--quantization-group-size 32 divides it"):
        Int4LinearMethod(64).create_weights(layer, 96, 16, torch.float32)
    # no allowed group divides 80: the way out is int8 (per channel) or no quantization
    with pytest.raises(ValueError, match=r"input size 80 .*none of the group sizes 32, 64, 128 "
                                         r"divides it: use --quantization int8"):
        Int4LinearMethod(32).create_weights(layer, 80, 16, torch.float32)


def test_quantize_on_load_keeps_embedding_and_head_float():
    config = QuantizeOnLoadConfig("int4", 32)
    assert type(config.method_for(None, "lm_head")).__name__ == "FloatLinearMethod"
    assert isinstance(config.method_for(None, "layers.2.qkv_proj"), Int4LinearMethod)
    with pytest.raises(ValueError, match="quantization must be one of"):
        QuantizeOnLoadConfig("int3")
