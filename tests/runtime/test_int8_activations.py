"""int8 activations for int4 and int8 weights (native/int8_activations.h, `--activation-quantization
int8`), on every build this CPU can run.

What the kernel promises: each row of x is rounded per 32 values of k, d = max|x| / 127 and
xq = round-half-even(x * (127 / max|x|)) clamped to +-127, and y = (d * xq) @ W^T with the
integer sums exact and float32 rounding only where each 32-k block's sum is scaled and each
group folded: about 2 K / 32 + 4 roundings per term, so

    |y - y64| <= (2 K / 32 + 4) u * sum_k |d xq_k| * mag_k,     u = 2^-24,

with y64 the float64 product of the rounded x and the exact weight (the reference below
rounds x the same way in torch). One x value rounded to a neighbour moves y by ~d |w|, orders
of magnitude outside that bound, so the test also pins the rounding. Every build gives the
same bits, and a row's bits never depend on M (prefill rows take this path too).
"""

from __future__ import annotations

import pytest
import torch
from test_quant_matmul import BUILDS, INT4_FLAVOURS, U32, _int4_case, _int4_exact, _x

from quire import platform
from quire.config import EngineArgs
from quire.native import loader
from quire.native import quant_matmul as qm
from quire.validation import QuireValidationError

SHAPES = [(1, 16, 64), (3, 37, 128), (4, 100, 576), (5, 48, 256), (9, 33, 384),
          (17, 64, 1536), (40, 50, 128)]


@pytest.fixture(params=BUILDS)
def march(request):
    if qm._library(request.param) is None:
        pytest.fail(f"quant_matmul.cpp did not build for {request.param}")
    return request.param


def rounded_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it, in float64: d * xq per 32 values of k."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    live = amax >= 1e-30
    # float32 quotients, correctly rounded (through float64: torch divides by a scalar, and
    # a scalar by a tensor, with a reciprocal, which can move the last bit and so a tie)
    d = torch.where(live, (amax.double() / 127).float(), torch.zeros_like(amax))
    inverse = torch.where(live, (127 / amax.double()).float(), torch.zeros_like(amax))
    xq = torch.round(blocks * inverse)
    return (xq.clamp(-127, 127).double() * d.double()).reshape(m, k)


def _vnni(march) -> bool:
    """Whether the build has AVX512-VNNI (int8 weights take int8 activations only there): a
    named build's flags, or this CPU's for the native one."""
    flags = loader.ISA_BUILDS[march][1] if march in loader.ISA_BUILDS else platform.cpu_flags()
    return "avx512_vnni" in flags


def _packed_int8(n, k, group, march, seed=0):
    """An int8 weight (q in -128..127, as GGUF's Q8_0 allows) and its exact values, |w|; int8
    activations on where the build takes them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-4).half().float()
    packed = qm.pack_int8(q, s, group, _march=march)
    assert packed.use_int8_activations() == _vnni(march), march
    w64 = q.double() * s.double().repeat_interleave(group, dim=1)
    return packed, (w64, w64.abs())


def _packed(n, k, group, flavour, march, seed=0):
    qweight, scales, zeros = _int4_case(n, k, group, seed, flavour)
    packed = qm.pack_int4(qweight, scales, zeros, group, _march=march)
    assert packed.use_int8_activations()
    return packed, _int4_exact(qweight, scales, zeros, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flavour", sorted(INT4_FLAVOURS))
@pytest.mark.parametrize("group", [32, 64, 128])
def test_rounded_x_times_the_exact_weight_within_the_bound(march, flavour, group, dtype):
    for m, n, k in SHAPES:
        if k % group:
            continue
        packed, (w64, magnitude) = _packed(n, k, group, flavour, march)
        assert packed.form == INT4_FLAVOURS[flavour][0]
        x = _x(m, k, dtype, seed=m + k)
        y = qm.int4_linear(x, packed)
        x64 = rounded_x(x)
        want = x64 @ w64.T
        bound = (2 * k // 32 + 4) * U32 * (x64.abs() @ magnitude.T)
        if dtype == torch.bfloat16:  # one rounding of y to 8 significant bits
            bound = bound * (1 + 2.0 ** -8) + 2.0 ** -8 * want.abs()
        worst = ((y.double() - want).abs() / bound.clamp_min(1e-300)).max().item()
        assert worst <= 1.0, f"{(m, n, k)}: error {worst:.3g} x the bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
def test_int8_weights_rounded_x_times_the_exact_weight_within_the_bound(march, group, dtype):
    """GGUF's Q8_0 (the default model's LM head) with int8 activations: the same bound, on
    builds with AVX512-VNNI; the others keep float x for int8 weights (their signed-byte
    products cost more than the float path), so their results are the float path's."""
    for m, n, k in SHAPES:
        if k % group:
            continue
        packed, (w64, magnitude) = _packed_int8(n, k, group, march, seed=m)
        x = _x(m, k, dtype, seed=m + k)
        y = qm.int8_linear(x, packed)
        if not _vnni(march):
            packed.use_int8_activations(False)
            assert torch.equal(y, qm.int8_linear(x, packed))
            continue
        x64 = rounded_x(x)
        want = x64 @ w64.T
        bound = (2 * k // 32 + 4) * U32 * (x64.abs() @ magnitude.T)
        if dtype == torch.bfloat16:
            bound = bound * (1 + 2.0 ** -8) + 2.0 ** -8 * want.abs()
        worst = ((y.double() - want).abs() / bound.clamp_min(1e-300)).max().item()
        assert worst <= 1.0, f"{(m, n, k)}: error {worst:.3g} x the bound"


def test_one_value_rounded_the_other_way_is_far_outside_the_bound(march):
    packed, (w64, magnitude) = _packed(64, 256, 32, "min16", march)
    x = _x(1, 256, torch.float32, seed=3)
    y = qm.int4_linear(x, packed).double()
    x64 = rounded_x(x)
    bound = (2 * 256 // 32 + 4) * U32 * (x64.abs() @ magnitude.T)
    nudged = x64.clone()
    nudged[0, 5] += x64[0, :32].abs().max() / 127  # one step of that block's int8 grid
    assert ((y - nudged @ w64.T).abs() > 100 * bound).any()


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("group", [32, 64])
def test_every_build_gives_the_same_bits_and_rows_do_not_depend_on_m(group, weights):
    """Every path: the scalar, AVX2 and AVX512-VNNI rows (tiles of 1-4; on VNNI builds from 5
    rows, chunks of up to 64 through each unpacked block: 150 rows are 64, 64 and 22), the AMX
    tiles from 5 rows (streamed up to 16, expanded beyond). int8 weights: the builds with AVX512-VNNI (the
    others keep float x for them)."""
    x = _x(150, 576, torch.float32, seed=7)
    outputs = {}
    linear = qm.int4_linear if weights == "int4" else qm.int8_linear
    for march in BUILDS if weights == "int4" else [b for b in BUILDS if _vnni(b)]:
        if weights == "int4":
            packed, _ = _packed(70, 576, group, "min16", march)
        else:
            packed, _ = _packed_int8(70, 576, group, march)
        whole = linear(x, packed)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 23, 65):  # alone, beside others, past a tile
            parts = torch.cat([linear(x[i:i + rows], packed)
                               for i in range(0, x.shape[0], rows)])
            assert torch.equal(parts, whole), (march, rows)
        outputs[march] = whole
    first = next(iter(outputs.values()))
    assert all(torch.equal(first, y) for y in outputs.values()), list(outputs)


def test_the_thread_count_does_not_change_a_bit(march):
    packed, _ = _packed(300, 256, 64, "zero32", march)
    x = _x(6, 256, torch.float32, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qm.int4_linear(x, packed)
        torch.set_num_threads(max(2, before))
        assert torch.equal(one, qm.int4_linear(x, packed))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [4, 7])  # (VNNI builds: q8_rows; from 5 rows q8_through)
def test_zero_tiny_and_non_finite_blocks(march, rows):
    packed, (w64, _) = _packed(32, 128, 32, "zero16", march)
    x = _x(rows, 128, torch.float32, seed=4)
    x[0] = 0.0  # a zero row: y is the offsets' part, zero here too
    x[1, 32:64] = 1e-31  # a block below 1e-30 counts as zeros
    x[2, 70] = float("inf")
    x[3, 3] = float("nan")
    y = qm.int4_linear(x, packed)
    assert torch.equal(y[0], torch.zeros(32))
    want1 = rounded_x(x[1:2]) @ w64.T
    assert torch.allclose(y[1].double(), want1[0], rtol=1e-5, atol=1e-6)
    assert y[2].isnan().all() and y[3].isnan().all()
    assert y[4:].isfinite().all()  # other rows untouched
    assert torch.equal(qm.int4_linear(x[1:2], packed), y[1:2])


def test_weights_it_does_not_apply_to_keep_the_float_path():
    """bfloat16 weights, and int8 ones whose groups are not whole 32-k blocks."""
    q8, s8 = torch.randint(-127, 128, (40, 64), dtype=torch.int8), torch.rand(40, 4) * 0.01
    int8 = qm.pack_int8(q8, s8, 16)
    bf16 = qm.pack_bf16(torch.randn(40, 64).bfloat16())
    x = torch.randn(3, 64)
    for packed, fn in ((int8, qm.int8_linear), (bf16, qm.bf16_linear)):
        before = fn(x, packed)
        assert not packed.use_int8_activations() and not packed.int8_activations
        assert torch.equal(fn(x, packed), before)


def test_turning_it_off_gives_the_float_path_back():
    packed, _ = _packed(48, 128, 32, "min16", "native")
    x = _x(2, 128, torch.float32, seed=1)
    rounded = qm.int4_linear(x, packed)
    packed.use_int8_activations(False)
    exact = qm.int4_linear(x, packed)
    assert not torch.equal(rounded, exact)
    assert torch.allclose(rounded, exact, rtol=0.05, atol=0.05)


def test_a_wrong_value_names_the_field():
    with pytest.raises(QuireValidationError, match="activation_quantization"):
        EngineArgs(activation_quantization="int4")


def test_without_the_library_nothing_takes_it(monkeypatch):
    """The torch path keeps float x, so a weight packed without the library says it does."""
    qweight, scales, zeros = _int4_case(40, 128, 32, seed=8)
    try:
        with monkeypatch.context() as patch:
            patch.setenv("QUIRE_CPU_KERNELS", "0")
            qm._library.cache_clear()
            loader.load_library.cache_clear()
            packed = qm.pack_int4(qweight, scales, zeros, 32)
            assert not packed.use_int8_activations() and not packed.int8_activations
    finally:
        qm._library.cache_clear()
        loader.load_library.cache_clear()
    assert qm.available()
