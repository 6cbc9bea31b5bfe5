"""The native int8 / int4 weight-only matmul (native/quant_matmul) against
dequantize-then-matmul in float64, on every build this CPU can run (ids: native, then each
ISA named for the CPU feature it needs: scalar, avx2, avx512, avx512_bf16, amx), plus its
torch path where the library can't be built. On each build a row of y has the same bits
whatever rows come with it (batch invariance).

Tolerance, from float32 rounding alone. The kernel never rounds a weight or x to a narrower
type: per group of G it sums x_k * q'_k in float32 (q' the small integer q or q - 8,
converted exactly), then adds s * part and offset * sum(x) with FMAs (w = q s + m is the same
real number as (q - 8) s + z when pack_int4 picks it: m = z - 8 s exactly; the AVX512-BF16
path multiplies bfloat16 x by q' looked up as an exact bfloat16, products exact). Every term
of y = sum_k x_k w_k is then a sum of at most G + 2 K / G + 1 <= K + 4 float32 roundings
away from exact, so (Higham, Accuracy and Stability of Numerical Algorithms, 3.1)
    |y - y64| <= (K + 4) u * sum_k |x_k| * mag_k,     u = 2^-24,
mag_k = |q' s| + |offset| (for int4 the larger of the two forms' magnitudes), plus one bfloat16
rounding of y for bfloat16 x. It holds for any summation order, and a wrong nibble, scale or
row breaks it by orders of magnitude (test_one_wrong_weight_is_far_outside_the_bound).
"""

from __future__ import annotations

import pytest
import torch

from quire.native import loader
from quire.native import quant_matmul as qm

U32 = 2.0 ** -24
# (M, N, K): odd M, M above the kernel's row tile, N not a multiple of the 16-row block
SHAPES = [(1, 16, 64), (3, 37, 128), (8, 960, 576), (9, 100, 256), (17, 33, 384),
          (32, 576, 1536), (70, 50, 128), (2, 2051, 128), (10, 24, 63)]  # odd K: int8 only


def _cases(groups):
    """Every shape with every group that divides its K (576 = 4.5 x 128 takes 32 and 64)."""
    return [(m, n, k, g) for m, n, k in SHAPES for g in groups if g == "channel" or k % g == 0]


def _int8_case(n, k, group, seed, half=False):
    """Random int8 weight; `half`: scales that are exactly float16 (GGUF Q8_0's d)."""
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-4
    return qweight, scales.half().float() if half else scales


# int4 scale / zero flavours and the weight form and scale dtype pack_int4 must pick for each
INT4_FLAVOURS = {
    "symmetric16": (qm.INT4_SYMMETRIC, torch.float16),  # GGUF Q4_0
    "symmetric32": (qm.INT4_SYMMETRIC, torch.float32),
    "min16": (qm.INT4_MIN, torch.float16),  # GGUF Q4_1: zero = m + 8 d
    "min32": (qm.INT4_MIN, torch.float32),  # z - 8 s exact in float32 only
    "zero16": (qm.INT4_ZERO, torch.float16),  # s and z float16, z - 8 s not
    "zero32": (qm.INT4_ZERO, torch.float32),  # z - 8 s not even a float32
}


def _int4_case(n, k, group, seed, flavour="zero32"):
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    shape = (n, k // group)
    scales = torch.rand(shape, generator=g) * 0.02 + 1e-4
    zeros = torch.randn(shape, generator=g) * 0.05
    if flavour.startswith("symmetric"):
        zeros = torch.zeros(shape)
    if flavour.endswith("16"):
        scales = scales.half().float()
    if flavour == "zero16":
        zeros = zeros.half().float()
    if flavour == "min16":
        zeros = -(torch.rand(shape, generator=g) * 0.1).half().float() + 8 * scales
    if flavour == "min32":  # s on a 2^-30 grid (not float16), m on 2^-24: z = m + 8 s exact
        scales = torch.randint(1, 1 << 12, shape, generator=g) * 2.0 ** -30
        zeros = torch.randint(-(1 << 12), 1 << 12, shape, generator=g) * 2.0 ** -24 + 8 * scales
    return qweight, scales, zeros


def _int8_exact(qweight, scales, group):
    """float64 weight and the per-element magnitude the rounding bound scales with."""
    w = qweight.double() * scales.double().repeat_interleave(group, dim=1)
    return w, w.abs()


def _int4_exact(qweight, scales, zeros, group):
    q = torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1).double()
    s = scales.double().repeat_interleave(group, dim=1)
    z = zeros.double().repeat_interleave(group, dim=1)
    magnitude = torch.maximum(((q - 8) * s).abs() + z.abs(), (q * s).abs() + (z - 8 * s).abs())
    return (q - 8) * s + z, magnitude


def _assert_within_bound(y, x, w64, magnitude):
    x64 = x.double()
    want = x64 @ w64.T
    bound = (x.shape[1] + 4) * U32 * (x64.abs() @ magnitude.T)
    if y.dtype == torch.bfloat16:  # one rounding of the result to 8 significant bits
        bound = bound * (1 + 2.0 ** -8) + 2.0 ** -8 * want.abs()
    err = (y.double() - want).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert worst <= 1.0, f"error {worst:.3g} x the fp32 rounding bound"
    return want


def _x(m, k, dtype, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


with open("/proc/cpuinfo") as _f:
    _FLAGS = _f.read()
# this CPU's own build, then every ISA build it can execute (loader.ISA_BUILDS: an
# AVX-512 CPU runs the AVX2 and plain C++ paths too, with AMX all of them)
BUILDS = ["native", *loader.isa_builds()]
# the vector path each build takes
ISA_PATHS = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx512",
             "avx512_bf16": "avx512-bf16", "amx": "amx"}


@pytest.fixture(params=BUILDS)
def march(request):
    """The library built for this CPU, then for each older ISA this CPU can also run."""
    if qm._library(request.param) is None:
        pytest.fail(f"quant_matmul.cpp did not build for {request.param}")
    return request.param


def test_every_isa_this_cpu_has_is_built_and_tested():
    """The matrix skips no ISA the CPU can execute (its /proc/cpuinfo flags)."""
    flags = set(_FLAGS.split())
    want = {"scalar"} | {name for name, flag in (("avx2", "avx2"), ("avx512", "avx512f"),
                                                 ("avx512_bf16", "avx512_bf16"),
                                                 ("amx", "amx_bf16")) if flag in flags}
    assert want <= set(BUILDS)


def test_builds_use_the_vector_paths_this_cpu_has(march):
    if march != "native":
        assert qm.isa(march) == ISA_PATHS[march]
    else:
        assert qm.isa(march) == ("amx" if " amx_bf16" in _FLAGS else
                                 "avx512-bf16" if " avx512_bf16" in _FLAGS else
                                 "avx512" if " avx512f" in _FLAGS else
                                 "avx2" if " avx2" in _FLAGS else "scalar")
    assert qm.available()
    # an AMX build uses the tiles wherever the CPU has them (the kernel grants the state)
    assert qm.amx_ready(march) == (qm.isa(march) == "amx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group", _cases(["channel", 32, 64, 128]))
def test_int8_linear_matches_dequantize_then_matmul(march, m, n, k, group, dtype):
    group = k if group == "channel" else group
    half = (m + n) % 2 == 0  # half the cases with float16 scales (as GGUF Q8_0 has)
    qweight, scales = _int8_case(n, k, group, seed=m * n + k, half=half)
    packed = qm.pack_int8(qweight, scales, group, _march=march)
    assert packed.scales.dtype == (torch.float16 if half else torch.float32)
    x = _x(m, k, dtype, seed=m)
    y = qm.int8_linear(x, packed)
    assert y.shape == (m, n) and y.dtype == dtype
    _assert_within_bound(y, x, *_int8_exact(qweight, scales, group))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group,flavour", [
    case + (list(INT4_FLAVOURS)[i % len(INT4_FLAVOURS)],)
    for i, case in enumerate(_cases(qm.INT4_GROUPS))])
def test_int4_linear_matches_dequantize_then_matmul(march, m, n, k, group, flavour, dtype):
    qweight, scales, zeros = _int4_case(n, k, group, seed=m * n + k, flavour=flavour)
    packed = qm.pack_int4(qweight, scales, zeros, group, _march=march)
    assert (packed.form, packed.scales.dtype) == INT4_FLAVOURS[flavour]
    x = _x(m, k, dtype, seed=m)
    y = qm.int4_linear(x, packed)
    assert y.shape == (m, n) and y.dtype == dtype
    _assert_within_bound(y, x, *_int4_exact(qweight, scales, zeros, group))


def _formed(packed):
    """Each weight [N, K] as the kernel forms it: s * q' rounded to float32 (q' = q, or q - 8),
    then the offset added and rounded again; where there is none, dequantize()'s float."""
    q = qm._unblock(packed.qweight, packed.n)
    scales = qm._unblock(packed.scales, packed.n).float().repeat_interleave(packed.group, dim=1)
    if packed.form == qm.INT8:
        return q.float() * scales
    if packed.form != qm.INT4_MIN:
        q = q ^ 0x88
    nibbles = torch.stack([q & 15, q >> 4], dim=-1).reshape(packed.n, packed.k).float()
    w = (nibbles if packed.form == qm.INT4_MIN else nibbles - 8) * scales
    if packed.offsets is None:
        return w
    return w + qm._unblock(packed.offsets, packed.n).float().repeat_interleave(packed.group, 1)


@pytest.mark.parametrize("flavour", [*INT4_FLAVOURS, "int8-g32", "int8-channel"])
def test_one_hot_rows_give_each_weight_as_the_kernel_forms_it(flavour, march):
    """With one-hot rows of x (every product but one a zero) y is one weight: s * q' plus the
    offset, each rounded to float32, bit for bit (the right nibble, scale and offset of the
    right row), whether the call expands its row blocks (M = K) or streams them (2 rows a
    call). Without an offset that is dequantize()'s float."""
    n, k = 37, 128
    if flavour.startswith("int8"):
        group = k if flavour == "int8-channel" else 32
        packed = qm.pack_int8(*_int8_case(n, k, group, seed=5), group, _march=march)
        linear = qm.int8_linear
    else:
        packed = qm.pack_int4(*_int4_case(n, k, 32, seed=5, flavour=flavour), 32, _march=march)
        linear = qm.int4_linear
    want = _formed(packed).T
    if packed.offsets is None:
        assert torch.equal(want, qm.dequantize(packed).T)
    assert torch.equal(linear(torch.eye(k), packed), want)
    assert torch.equal(torch.cat([linear(rows, packed) for rows in torch.eye(k).split(2)]), want)


@pytest.mark.parametrize("flavour", INT4_FLAVOURS)
def test_each_int4_flavour_packs_to_its_form_with_the_same_weight(flavour):
    qweight, scales, zeros = _int4_case(33, 128, 32, seed=7, flavour=flavour)
    packed = qm.pack_int4(qweight, scales, zeros, 32)
    assert (packed.form, packed.scales.dtype) == INT4_FLAVOURS[flavour]
    want, _ = _int4_exact(qweight, scales, zeros, 32)
    assert (qm.dequantize(packed).double() - want).abs().max() <= U32 * want.abs().max()
    x = _x(3, 128, torch.float32, seed=7)
    _assert_within_bound(qm.int4_linear(x, packed), x, *_int4_exact(qweight, scales, zeros, 32))


def test_gguf_q4_0_q4_1_and_q8_0_blocks(march):
    """The formats the GGUF loader hands in: Q4_0 (zero = 0), Q4_1 (zero = m + 8 d), Q8_0;
    each kept with its own float16 d (and m): the kernel reads no more bytes than the file."""
    n, k = 49, 576
    g = torch.Generator().manual_seed(5)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    mins = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    q4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    x = _x(5, k, torch.float32, seed=1)
    for zeros, form in ((torch.zeros_like(d), qm.INT4_SYMMETRIC), (mins + 8 * d, qm.INT4_MIN)):
        packed = qm.pack_int4(q4, d, zeros, 32, _march=march)
        assert packed.form == form and packed.scales.dtype == torch.float16
        if form == qm.INT4_MIN:
            assert torch.equal(qm._unblock(packed.offsets, n).float(), mins)
        _assert_within_bound(qm.int4_linear(x, packed), x, *_int4_exact(q4, d, zeros, 32))
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    packed = qm.pack_int8(q8, d, 32, _march=march)
    assert packed.scales.dtype == torch.float16
    _assert_within_bound(qm.int8_linear(x, packed), x, *_int8_exact(q8, d, 32))


def test_one_wrong_weight_is_far_outside_the_bound(march):
    """The bound is tight enough to matter: a kernel that reads one nibble wrong fails it."""
    n, k, group = 20, 128, 32
    qweight, scales, zeros = _int4_case(n, k, group, seed=3)
    x = _x(4, k, torch.float32, seed=2)
    y = qm.int4_linear(x, qm.pack_int4(qweight, scales, zeros, group, _march=march))
    corrupted = qweight.clone()
    corrupted[17, 40] ^= 0x10  # k = 81 of row 17, high nibble
    with pytest.raises(AssertionError, match="rounding bound"):
        _assert_within_bound(y, x, *_int4_exact(corrupted, scales, zeros, group))


@pytest.mark.parametrize("m", [1, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_thread_count_does_not_change_a_bit(dtype, m, march):
    """Each output row is summed by one thread in one order, however many threads there are."""
    qweight, scales, zeros = _int4_case(300, 256, 64, seed=11, flavour="min16")
    p4 = qm.pack_int4(qweight, scales, zeros, 64, _march=march)
    p8 = qm.pack_int8(*_int8_case(300, 256, 32, seed=12), 32, _march=march)
    x = _x(m, 256, dtype, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qm.int4_linear(x, p4), qm.int8_linear(x, p8)
        torch.set_num_threads(max(2, before))
        many = qm.int4_linear(x, p4), qm.int8_linear(x, p8)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, many):
        assert torch.equal(a, b)


def test_dequantize_gives_back_the_canonical_weight():
    n, k = 21, 64
    qweight, scales = _int8_case(n, k, 32, seed=1)
    torch.testing.assert_close(qm.dequantize(qm.pack_int8(qweight, scales, 32)),
                               _int8_exact(qweight, scales, 32)[0].float(), rtol=0, atol=0)
    qweight, scales, zeros = _int4_case(n, k, 64, seed=2)
    want = _int4_exact(qweight, scales, zeros, 64)[0]
    got = qm.dequantize(qm.pack_int4(qweight, scales, zeros, 64)).double()
    assert ((got - want).abs() <= U32 * want.abs() + 1e-12).all()


def test_leading_dims_and_non_contiguous_x():
    qweight, scales = _int8_case(24, 64, 64, seed=4)
    packed = qm.pack_int8(qweight, scales, 64)
    x = _x(6, 128, torch.float32, seed=3)[:, ::2]  # stride 2 along K
    y = qm.int8_linear(x.reshape(2, 3, 64), packed)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y.reshape(6, 24), qm.int8_linear(x.contiguous(), packed),
                               rtol=0, atol=0)


def test_empty_batch():
    qweight, scales = _int8_case(24, 64, 64, seed=4)
    assert qm.int8_linear(torch.zeros(0, 64), qm.pack_int8(qweight, scales, 64)).shape == (0, 24)


@pytest.mark.parametrize("call,match", [
    (lambda: qm.pack_int8(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2), 32),
     "qweight must be torch.int8"),
    (lambda: qm.pack_int8(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3), 32),
     r"scales must have shape \[4, 2\]"),
    (lambda: qm.pack_int8(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2), 48),
     "group must be a positive divisor of K=64"),
    (lambda: qm.pack_int4(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 8),
                          torch.ones(4, 8), 16), r"group must be one of \(32, 64, 128\)"),
    (lambda: qm.pack_int4(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 4),
                          torch.ones(4, 4, dtype=torch.float16), 32), "zeros must be torch.float32"),
    (lambda: qm.int8_linear(torch.zeros(2, 64, dtype=torch.float16), _packed8()),
     "x must be a float32 or bfloat16 CPU tensor"),
    (lambda: qm.int8_linear(torch.zeros(2, 65), _packed8()), r"x must have shape \[M, 64\]"),
    (lambda: qm.int4_linear(torch.zeros(2, 64), _packed8()), "packed must come from pack_int4"),
])
def test_bad_input_names_the_field(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _packed8():
    return qm.pack_int8(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1), 64)


def test_without_the_library_the_torch_path_gives_the_same_results(monkeypatch):
    qweight, scales, zeros = _int4_case(40, 128, 32, seed=8)
    q8, s8 = _int8_case(40, 128, 128, seed=9)
    x = _x(5, 128, torch.bfloat16, seed=4)
    try:
        with monkeypatch.context() as patch:
            patch.setenv("QUIRE_CPU_KERNELS", "0")
            qm._library.cache_clear()
            loader.load_library.cache_clear()
            assert not qm.available() and qm.isa() is None
            y4 = qm.int4_linear(x, qm.pack_int4(qweight, scales, zeros, 32))
            y8 = qm.int8_linear(x, qm.pack_int8(q8, s8, 128))
    finally:
        qm._library.cache_clear()
        loader.load_library.cache_clear()
    _assert_within_bound(y4, x, *_int4_exact(qweight, scales, zeros, 32))
    _assert_within_bound(y8, x, *_int8_exact(q8, s8, 128))
    assert qm.available()


@pytest.mark.parametrize("flavour", [*INT4_FLAVOURS, "int8-channel", "int8-g32"])
def test_prefill_sized_float32_m_stays_within_the_bound(flavour, march):
    """Prefill-sized float32 x runs the kernel's tiles on every build (AVX2: 6 rows each,
    here 22 of them and a last one of a single row; AVX-512: 16 of 8 and one of 5) within the
    same bound, and its first rows are those of a call with those rows alone."""
    m, n, k = 133, 70, 256
    if flavour.startswith("int8"):
        group = k if flavour == "int8-channel" else 32
        qweight, scales = _int8_case(n, k, group, seed=3, half=group == 32)
        packed = qm.pack_int8(qweight, scales, group, _march=march)
        exact, linear = _int8_exact(qweight, scales, group), qm.int8_linear
    else:
        qweight, scales, zeros = _int4_case(n, k, 32, seed=3, flavour=flavour)
        packed = qm.pack_int4(qweight, scales, zeros, 32, _march=march)
        exact, linear = _int4_exact(qweight, scales, zeros, 32), qm.int4_linear
    x = _x(m, k, torch.float32, seed=4)
    y = linear(x, packed)
    _assert_within_bound(y, x, *exact)
    torch.testing.assert_close(y[:7], linear(x[:7], packed), rtol=0, atol=0)  # rows alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flavour", [*INT4_FLAVOURS, "int8-g32", "int8-channel", "int8-odd-k"])
def test_a_row_has_the_same_bits_whatever_rows_come_with_it(flavour, dtype, march):
    """Batch invariance, which the engine's exactness rests on: a row of x gives the same y
    bit for bit alone, in a decode-sized call (streamed: few rows beside it, a tile of any
    size) or a prefill-sized one (expanded: at any place in any tile), on every build."""
    n, k = 70, 63 if flavour == "int8-odd-k" else 256  # odd K: one group, bfloat16 as float32
    if flavour.startswith("int8"):
        group = 32 if flavour == "int8-g32" else k
        packed = qm.pack_int8(*_int8_case(n, k, group, seed=3, half=group == 32), group,
                              _march=march)
        linear = qm.int8_linear
    else:
        packed = qm.pack_int4(*_int4_case(n, k, 32, seed=3, flavour=flavour), 32, _march=march)
        linear = qm.int4_linear
    x = _x(40, k, dtype, seed=4)
    y = linear(x, packed)
    # an AMX build's calls of fewer than AMX_MIN_ROWS bfloat16 rows keep the dot product:
    # invariant among themselves (against 2-row calls), within the bound of the tiles' sums
    few = qm.amx_rows_differ(march, dtype, packed)
    pairs = torch.cat([linear(x[i:i + 2], packed) for i in range(0, 40, 2)]) if few else y
    threshold = qm._amx_min_rows_in_force(march) if few else 1
    # every streamed tile (two 16-row ones at 17-32 on AMX) and expanded one
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 24, 32, 33):
        want = pairs if m < threshold else y
        assert torch.equal(linear(x[:m], packed), want[:m]), f"the first {m} rows"
        assert torch.equal(linear(x[-m:], packed), want[-m:]), f"the last {m} rows"
    assert torch.equal(torch.cat([linear(row[None], packed) for row in x]), pairs), "rows alone"


@pytest.mark.parametrize("flavour", ["min32", "symmetric32", "zero32", "int8-g32"])
def test_streamed_bf16_rows_keep_the_dot_products_bits_at_the_edges(flavour, march):
    """On an AMX build streamed bfloat16 rows (decode) run float32 FMAs in the AVX512-BF16 dot
    product's order, and read denormal x as zero as it does: the same bits as the instruction
    gives them (the avx512_bf16 build's rows, this CPU running both) and as its own expanded
    rows (prefill-sized calls) on builds without tiles, for x with denormals, zeros of both
    signs and values from 1e-30 to 1e30 side by side."""
    n, k = 70, 256

    def pack(build):
        if flavour.startswith("int8"):
            return qm.pack_int8(*_int8_case(n, k, 32, seed=3, half=True), 32, _march=build)
        return qm.pack_int4(*_int4_case(n, k, 32, seed=3, flavour=flavour), 32, _march=build)

    packed = pack(march)
    linear = qm.int8_linear if flavour.startswith("int8") else qm.int4_linear
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(40, k, generator=gen) * 10.0 ** torch.randint(-30, 31, (40, k), generator=gen)
    bits = x.to(torch.bfloat16).view(torch.int16)
    denormal = torch.randint(1, 0x7f, (40, k), dtype=torch.int16, generator=gen)
    pick = torch.rand(40, k, generator=gen)
    bits = torch.where(pick < 0.1, denormal, bits)  # positive denormals
    bits = torch.where((pick >= 0.1) & (pick < 0.15), denormal | -0x8000, bits)  # negative
    bits = torch.where((pick >= 0.15) & (pick < 0.2), torch.tensor(-0x8000, dtype=torch.int16),
                       bits)  # -0.0
    x = bits.view(torch.bfloat16)
    x[3] = (x[3].view(torch.int16) & 0x7f).view(torch.bfloat16)  # a row of denormals (and 0)
    y = linear(x, packed)  # 40 rows: expanded (or the tiles)
    streamed = torch.cat([linear(row[None], packed) for row in x])
    if qm.amx_rows_differ(march, torch.bfloat16, packed):  # the tiles sum in their own order
        assert torch.equal(streamed, torch.cat([linear(x[i:i + 2], packed)
                                                for i in range(0, 40, 2)]))
    else:
        assert torch.equal(streamed, y)
    if qm.isa(march) == "amx":  # the FMAs against the instruction itself
        dot = pack("avx512_bf16")
        assert qm.isa("avx512_bf16") == "avx512-bf16"
        assert torch.equal(streamed, torch.cat([linear(row[None], dot) for row in x]))
    if qm.isa(march) in ("amx", "avx512-bf16") and flavour == "symmetric32":
        # denormal x read as zero (forms with an offset add z * sum(x), summed unflushed)
        assert torch.equal(linear(x[3:4], packed), torch.zeros(1, n, dtype=torch.bfloat16))


@pytest.mark.parametrize("bits", [4, 8])
def test_streamed_bf16_rows_add_each_pair_of_k_odd_first(bits, march):
    """Where the order shows: x = [1, 2^24, -2^24, 1] against weights of 1. The AVX512-BF16
    dot product adds k = 1 before k = 0 (2^24 + 1 rounds to 2^24, then 2^24 - 2^24 = 0, then
    k = 3, k = 2: 0); in k order the sum is 1. An AMX build's streamed rows (FMAs) take the
    instruction's order, as its own rows do; builds without it (float32 rows) sum in k
    order."""
    n, k = 16, 32
    if bits == 4:
        qweight = torch.full((n, k // 2), 0x99, dtype=torch.uint8)  # every nibble 9: q - 8 = 1
        packed = qm.pack_int4(qweight, torch.ones(n, 1), torch.zeros(n, 1), 32, _march=march)
        linear = qm.int4_linear
    else:
        packed = qm.pack_int8(torch.ones(n, k, dtype=torch.int8), torch.ones(n, 1), 32,
                              _march=march)
        linear = qm.int8_linear
    x = torch.zeros(40, k)
    x[:, :4] = torch.tensor([1.0, 2.0 ** 24, -2.0 ** 24, 1.0])
    x = x.to(torch.bfloat16)
    dot = qm.isa(march) in ("amx", "avx512-bf16")
    want = torch.full((1, n), 0.0 if dot else 1.0, dtype=torch.bfloat16)
    assert torch.equal(linear(x[:1], packed), want)
    if not qm.amx_rows_differ(march, torch.bfloat16, packed):  # expanded rows: the instruction
        assert torch.equal(linear(x, packed), want.expand(40, n))


@pytest.mark.parametrize("m, group", [(1, 32), (9, 32), (17, 64), (3, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_groups_sum_of_x_adds_its_k_in_order(m, group, dtype, march):
    """The offset's term sums x over each group in k order (one chain a group, whatever lanes
    the groups share): x = [1, 2^24, -2^24, 1] at a different place in each group sums to 1
    in k order (0 with each pair's k + 1 first, 2 backwards). Nibbles 0 under the min form
    (w = s q + m, m = 1) leave y = m * sum(x) alone. M x groups: 1, 2 lanes' worth and ragged
    tails (9 x 18 = 162 groups)."""
    n, k = 16, 576 if group == 32 else 384
    packed = qm.pack_int4(torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, k // group),
                          torch.full((n, k // group), 9.0), group, _march=march)
    assert packed.form == qm.INT4_MIN
    x = torch.zeros(m, k)
    for row in range(m):
        for g in range(k // group):
            at = g * group + (row + 3 * g) % (group - 3)
            x[row, at:at + 4] = torch.tensor([1.0, 2.0 ** 24, -2.0 ** 24, 1.0])
    y = qm.int4_linear(x.to(dtype), packed)
    assert torch.equal(y, torch.full((m, n), float(k // group), dtype=dtype))


@pytest.mark.parametrize("flavour", ["min16", "symmetric32", "int8-g32"])
def test_amx_min_rows_one_puts_every_bf16_row_in_one_order(flavour, march):
    """QUIRE_AMX_MIN_ROWS=1 (the library's threshold at 1): on an AMX build every bfloat16
    row goes to the tiles, so a row has the same bits alone, in 2 rows or in 40; elsewhere the
    threshold is not the library's to set and rows were invariant already."""
    k = 256
    if flavour.startswith("int8"):
        packed = qm.pack_int8(*_int8_case(70, k, 32, seed=3, half=True), 32, _march=march)
        linear = qm.int8_linear
    else:
        packed = qm.pack_int4(*_int4_case(70, k, 32, seed=3, flavour=flavour), 32,
                              _march=march)
        linear = qm.int4_linear
    x = _x(40, k, torch.bfloat16, seed=8)
    before = qm._set_amx_min_rows(1, march)
    try:
        assert qm._amx_min_rows_in_force(march) == (1 if qm.amx_ready(march) else 0)
        assert not qm.amx_rows_differ(march, torch.bfloat16, packed)
        y = linear(x, packed)
        assert torch.equal(torch.cat([linear(row[None], packed) for row in x]), y)
        assert torch.equal(torch.cat([linear(x[i:i + 2], packed) for i in range(0, 40, 2)]), y)
        _assert_within_bound(y, x, *(_int8_exact(*_int8_case(70, k, 32, seed=3, half=True), 32)
                                     if flavour.startswith("int8") else
                                     _int4_exact(*_int4_case(70, k, 32, seed=3,
                                                             flavour=flavour), 32)))
    finally:
        qm._set_amx_min_rows(max(1, before), march)


@pytest.mark.parametrize("value", ["0", "-2", "two", ""])
def test_amx_min_rows_names_the_variable(value, monkeypatch):
    monkeypatch.setenv("QUIRE_AMX_MIN_ROWS", value)
    with pytest.raises(ValueError, match="QUIRE_AMX_MIN_ROWS must be an integer >= 1"):
        qm.amx_min_rows()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 16, 64), (5, 37, 128), (9, 100, 256), (70, 50, 192),
                                   (3, 20, 63)])  # odd K: bfloat16 weights take any K
def test_bf16_weights_within_the_bound_and_batch_invariant(m, n, k, dtype, march):
    """pack_bf16 (a bfloat16 float model's weights, quant_kernels.DenseBf16Kernel): w exact in
    float32, one chain of FMAs over k per row, so the float32 bound above with mag = |w|; and
    a row's bits whatever rows come with it, as for the quantized forms."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    packed = qm.pack_bf16(weight, _march=march)
    assert packed.form == qm.BF16 and torch.equal(qm.dequantize(packed), weight.float())
    assert torch.equal(qm.dequantize_bf16(packed, march=march), weight)
    x = _x(m, k, dtype, seed=5)
    y = qm.bf16_linear(x, packed)
    _assert_within_bound(y, x, weight.double(), weight.double().abs())
    for rows in (1, 2, m):
        assert torch.equal(qm.bf16_linear(x[:rows], packed), y[:rows])
        assert torch.equal(qm.bf16_linear(x[-rows:], packed), y[-rows:])
    with pytest.raises(ValueError, match="must come from pack_int4"):
        qm.int4_linear(x, packed)


def test_pack_bf16_names_the_field():
    with pytest.raises(ValueError, match="weight must be torch.bfloat16"):
        qm.pack_bf16(torch.randn(16, 32))
    with pytest.raises(ValueError, match="weight must be a 2-D bfloat16 tensor"):
        qm.pack_bf16(torch.randn(32).bfloat16())
