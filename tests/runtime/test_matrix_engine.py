"""Quantized prefill on the CPU's matrix engine (native/matrix_engine.py): the weight
dequantized to bfloat16 by the native library, then torch's (oneDNN's) bfloat16 GEMM, which
runs on AMX where the CPU has it. QUIRE_MATRIX_ENGINE=1 takes that road on any CPU (slowly
without AMX), so every CPU tests what an AMX host runs.

Bound, against the native kernel's exact-weight product y64 (float64): the GEMM multiplies
bfloat16 x by the weight rounded to bfloat16 (relative error <= 2^-9 each) and sums in
float32, then rounds y to bfloat16:
    |y - y64| <= (2^-9 + K 2^-24) sum_k |x_k| |w_k| (1 + 2^-8) + 2^-8 |y64|.
"""

from __future__ import annotations

import pytest
import torch

from quire.layers import quant_kernels
from quire.layers.linear import MergedColumnParallelLinear
from quire.native import fused_ops, loader, matrix_engine
from quire.native import quant_matmul as qm

BUILDS = ["native", *loader.isa_builds()]


def _packed(form: str, n: int, k: int, seed: int = 0, march: str = "native"):
    g = torch.Generator().manual_seed(seed)
    if form == "int8":
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        return qm.pack_int8(q, (torch.rand(n, k // 32, generator=g) * 0.02).half().float(), 32,
                            _march=march)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4
    z = {"q4_0": torch.zeros(n, k // 32),
         "q4_1": -(torch.rand(n, k // 32, generator=g) * 0.1).half().float() + 8 * s.half().float(),
         "zero32": torch.randn(n, k // 32, generator=g) * 0.05}[form]
    if form != "zero32":
        s = s.half().float()
    return qm.pack_int4(q, s, z, 32, _march=march)


FORMS = ["int8", "q4_0", "q4_1", "zero32"]


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("form", FORMS)
def test_dequantize_bf16_is_the_canonical_weight_rounded_once(form, march):
    packed = _packed(form, 37, 128, march=march)  # 37 rows: a padded last block
    got = qm.dequantize_bf16(packed, march=march)
    assert torch.equal(got, qm.dequantize(packed).bfloat16())


@pytest.mark.parametrize("form", FORMS)
def test_forced_on_a_prefill_takes_the_gemm_within_the_bound(form, monkeypatch):
    monkeypatch.setenv("QUIRE_MATRIX_ENGINE", "1")
    n, k, m = 96, 256, matrix_engine.MIN_ROWS + 3
    packed = _packed(form, n, k)
    kernel = quant_kernels.NativeKernel("native", qm, qm.int4_linear if form != "int8"
                                        else qm.int8_linear, packed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    before = matrix_engine.calls
    y = kernel(x)
    assert matrix_engine.calls == before + 1 and y.dtype == torch.bfloat16
    w64 = qm.dequantize(packed).double()
    want = x.double() @ w64.T
    terms = x.double().abs() @ w64.abs().T
    bound = (2.0 ** -9 + k * 2.0 ** -24) * terms * (1 + 2.0 ** -8) + 2.0 ** -8 * want.abs()
    assert ((y.double() - want).abs() <= bound).all()
    # the same bfloat16 weight through F.linear: what a host without the library's tiles
    # computes, op for op (with them, the tiles sum each whole row of K as oneDNN's do here)
    assert torch.equal(y, torch.nn.functional.linear(x, qm.dequantize(packed).bfloat16()))
    # a wrong weight is far outside it
    broken = qm.dequantize(packed)
    broken[5, 7] += 100 * w64.abs().max().item()
    far = (x.double() @ broken.double().T - want).abs()
    assert (far > 10 * bound).any()


@pytest.mark.parametrize("setting", ["0", "1", "auto"])
def test_decode_rows_and_float32_x_never_leave_the_native_kernel(setting, monkeypatch):
    monkeypatch.setenv("QUIRE_MATRIX_ENGINE", setting)
    packed = _packed("q4_1", 64, 128)
    kernel = quant_kernels.NativeKernel("native", qm, qm.int4_linear, packed)
    before = matrix_engine.calls
    for x in (torch.randn(matrix_engine.MIN_ROWS - 1, 128).bfloat16(),  # verification, beams
              torch.randn(1, 128).bfloat16(),                           # decode
              torch.randn(2 * matrix_engine.MIN_ROWS, 128)):            # a float32 model
        assert torch.equal(kernel(x), qm.int4_linear(x, packed))
    assert matrix_engine.calls == before


def test_off_keeps_prefill_native_and_auto_needs_amx(monkeypatch):
    packed = _packed("q4_1", 64, 128)
    x = torch.randn(2 * matrix_engine.MIN_ROWS, 128).bfloat16()
    monkeypatch.setenv("QUIRE_MATRIX_ENGINE", "0")
    assert not matrix_engine.wants(x, packed, qm.int4_linear)
    monkeypatch.setenv("QUIRE_MATRIX_ENGINE", "auto")
    monkeypatch.setattr(matrix_engine, "_decision", None)
    with open("/proc/cpuinfo") as f:
        amx = "amx_bf16" in f.read()
    if not amx:  # no matrix engine: never taken, never measured
        assert not matrix_engine.available()
        assert not matrix_engine.wants(x, packed, qm.int4_linear)
        assert matrix_engine._decision is False
    elif qm.amx_ready():  # the library's own tiles: taken at once, whatever one call measures
        measured = []
        monkeypatch.setattr(matrix_engine, "_measure", lambda *a: measured.append(a) or False)
        assert matrix_engine.wants(x, packed, qm.int4_linear) and matrix_engine._decision
        assert not measured
    else:  # oneDNN's road (a build without the tiles): measured on this input, the faster kept
        decided = matrix_engine.wants(x, packed, qm.int4_linear)
        assert decided is matrix_engine._decision


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("form", FORMS)
def test_the_library_tiles_multiply_by_the_dequantize_bf16_weight(form, march):
    """quant_matmul.dequantized_linear (an AMX build with the tiles permitted; None
    elsewhere): the product by dequantize_bf16's weight, without a copy of it. One-hot rows
    of x read that weight back bit for bit (each output one exact product); random rows are
    within the bound above. 37 output rows: an odd number of row blocks, the last padded;
    rows 1-67: either tile of a 32-row pass, the last partly past M."""
    packed = _packed(form, 37, 128, seed=2, march=march)
    if not qm.amx_ready(march):
        assert qm.dequantized_linear(torch.ones(80, 128).bfloat16(), packed, march) is None
        return
    weight = qm.dequantize_bf16(packed, march=march)
    for m in (1, 16, 17, 33, 67):
        one_hot = torch.eye(128)[torch.arange(m) * 7 % 128].bfloat16()
        assert torch.equal(qm.dequantized_linear(one_hot, packed, march), one_hot @ weight.T)
    x = torch.randn(67, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    y = qm.dequantized_linear(x, packed, march)
    want = x.double() @ qm.dequantize(packed).double().T
    terms = x.double().abs() @ qm.dequantize(packed).double().abs().T
    bound = (2.0 ** -9 + 128 * 2.0 ** -24) * terms * (1 + 2.0 ** -8) + 2.0 ** -8 * want.abs()
    assert y.shape == (67, 37) and ((y.double() - want).abs() <= bound).all()
    assert torch.equal(y[:20], qm.dequantized_linear(x[:20], packed, march))  # row-invariant
    # what it leaves to torch: float32 x, and a K of no whole 32-k tiles (int8, per channel)
    assert qm.dequantized_linear(x.float(), packed, march) is None
    channel = qm.pack_int8(torch.ones(16, 40, dtype=torch.int8), torch.ones(16, 1), 40,
                           _march=march)
    assert qm.dequantized_linear(torch.ones(3, 40).bfloat16(), channel, march) is None


@pytest.mark.parametrize("group", [64, 128, "channel"])
def test_the_library_tiles_read_back_every_group_size(group):
    """Groups of 64 and 128 k (int4, each form) and one per row (int8): a pair of k never
    straddles two groups, and one-hot rows read dequantize_bf16's weight back exactly."""
    g = torch.Generator().manual_seed(5)
    n, k = 23, 256
    if group == "channel":
        weights = [qm.pack_int8(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g),
                                torch.rand(n, 1, generator=g), k)]
    else:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        s = torch.rand(n, k // group, generator=g) * 0.02
        half = s.half().float()
        weights = [qm.pack_int4(q, s, torch.randn(n, k // group, generator=g) * 0.05, group),
                   qm.pack_int4(q, s, torch.zeros_like(s), group),
                   qm.pack_int4(q, half, 8 * half - (torch.rand(n, k // group, generator=g)
                                                     * 0.1).half().float(), group)]
        assert {w.form for w in weights} == {qm.INT4_ZERO, qm.INT4_SYMMETRIC, qm.INT4_MIN}
    one_hot = torch.eye(k)[torch.arange(40) * 3 % k].bfloat16()
    for packed in weights:
        y = qm.dequantized_linear(one_hot, packed)
        if not qm.amx_ready():
            assert y is None
            continue
        assert torch.equal(y, one_hot @ qm.dequantize_bf16(packed).T), packed


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("form", FORMS)
def test_the_activation_fused_in_the_tiles_is_the_two_steps_bit_for_bit(form, march):
    """dequantized_linear(silu=...) of a gate|up weight: silu(gate) * up in the tiles'
    epilogue is fused_ops.silu_and_mul of the plain product, bit for bit. Parts of 48 rows
    (three row blocks: the third past the 32 columns torch's silu vectorizes, so std::exp
    there) and of 1536 (SmolLM2's); rows 1-67 (tiles partly past M); products past +-100 reach
    exp's overflow and underflow. None without the tiles, or where a part is no whole blocks."""
    silu = fused_ops.bf16_silu_exp(48)
    if qm.amx_ready(march):
        assert silu is not None  # an AMX CPU has AVX-512: Sleef's 16-lane exp is checked here
    g = torch.Generator().manual_seed(6)
    for n in (96, 3072):
        packed = _packed(form, n, 128, seed=n, march=march)
        x = (torch.randn(67, 128, generator=g) * (3 if form == "int8" else 192)).bfloat16()
        fused = qm.dequantized_linear(x, packed, march, silu=fused_ops.bf16_silu_exp(n // 2))
        if not qm.amx_ready(march):
            assert fused is None
            continue
        plain = qm.dequantized_linear(x, packed, march)
        assert plain.abs().max() > 100  # (exp(-100) and exp(100) are out of float's range)
        assert torch.equal(fused, fused_ops.silu_and_mul(plain))
        for m in (1, 17, 33):
            assert torch.equal(qm.dequantized_linear(x[:m], packed, march,
                                                     silu=fused_ops.bf16_silu_exp(n // 2)),
                               fused[:m])
    odd = _packed(form, 80, 128, march=march)  # parts of 40 rows: 2.5 blocks
    assert qm.dequantized_linear(torch.ones(70, 128).bfloat16(), odd, march, silu=silu) is None


def test_sleef_16_lane_exp_is_taken_only_where_it_matches_torchs():
    """bf16_exp16 checks Sleef's 16-lane exp against the 8-lane one torch's silu calls on all
    65,536 bfloat16 inputs: the same function passes, a different one (exp2) does not."""
    native = fused_ops._native()
    with open("/proc/cpuinfo") as f:
        avx512 = " avx512f" in f.read()
    exp16 = fused_ops.bf16_exp16()
    if not avx512:
        assert exp16 is None
        return
    assert exp16 is not None
    lib = native[0]
    exp2 = fused_ops._torch_function("Sleef_exp2f16_u10")
    assert lib.quire_exp16_matches_exp8(native[2], exp16) == 1
    assert lib.quire_exp16_matches_exp8(native[2], exp2) == 0


def test_a_gated_mlp_layer_fuses_its_activation_only_where_nothing_else_applies(monkeypatch):
    """MergedColumnParallelLinear.silu_and_mul: the fused road for a quantized gate|up on the
    matrix engine (one call, the two steps' bits), the two steps with a LoRA delta or decode
    rows (the fused kernel would drop the delta)."""
    monkeypatch.setenv("QUIRE_MATRIX_ENGINE", "1")
    layer = MergedColumnParallelLinear(128, [48, 48], quant_config=None, prefix="mlp.gate_up")
    packed = _packed("q4_1", 96, 128, seed=7)
    layer.quant_kernel = quant_kernels.NativeKernel("native", qm, qm.int4_linear, packed)
    layer.quant_method.apply = lambda lay, x, bias: lay.quant_kernel(x)
    x = torch.randn(70, 128, generator=torch.Generator().manual_seed(8)).bfloat16()
    two_steps = fused_ops.silu_and_mul(layer.quant_kernel(x))
    before = matrix_engine.calls
    assert torch.equal(layer.silu_and_mul(x), two_steps)
    fused = qm.amx_ready() and fused_ops.bf16_exp16() is not None
    assert matrix_engine.calls == before + 1  # one call: fused, or the plain product
    if fused:  # the kernel's own fused road on this CPU (not the two steps behind it)
        assert torch.equal(layer.quant_kernel.silu_and_mul(x), two_steps)
    # decode rows (fewer than the matrix engine's MIN_ROWS): never fused, the two steps
    few = x[: matrix_engine.MIN_ROWS - 1]
    assert layer.quant_kernel.silu_and_mul(few) is None
    assert torch.equal(layer.silu_and_mul(few), fused_ops.silu_and_mul(layer.quant_kernel(few)))
    taken = []
    monkeypatch.setattr(quant_kernels.NativeKernel, "silu_and_mul",
                        lambda self, x: taken.append(x) or None)
    assert torch.equal(layer.silu_and_mul(x), two_steps) and len(taken) == 1

    class Delta:
        def apply(self, x, y):
            return y + 1
    layer.lora = Delta()
    got = layer.silu_and_mul(x)
    assert len(taken) == 1  # never asked: the delta must be in the product
    assert torch.equal(got, fused_ops.silu_and_mul(layer.quant_kernel(x) + 1))
    assert fused or not qm.amx_ready()


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("QUIRE_MATRIX_ENGINE", "yes")
    with pytest.raises(ValueError, match="QUIRE_MATRIX_ENGINE must be one of auto, 0, 1"):
        matrix_engine.wants(torch.randn(128, 64).bfloat16(), _packed("int8", 16, 64),
                            qm.int8_linear)
