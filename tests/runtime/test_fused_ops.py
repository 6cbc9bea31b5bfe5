"""The fused decoder-layer ops are bit-identical to the torch operations they replace (the
transformers operation order), in float32 and bfloat16, over the shapes the models use and
awkward ones (odd widths, vector tails, strided views, many rows)."""

from __future__ import annotations

import pytest
import torch

from quire.native import fused_ops

DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def test_native_kernels_are_built():
    # this machine has a compiler and AVX2 or better: the tests below must exercise them
    assert fused_ops._native() is not None
    assert fused_ops._native()[2] is not None  # torch's Sleef exp was found


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (3, 64), (7, 100), (128, 576), (5, 2048),
                                    (2, 4096), (1, 8), (4, 17)])
def test_rms_norm_is_bit_identical(dtype, rows, n):
    x = _rand(rows, n, dtype=dtype, seed=1, scale=3.0)
    w = _rand(n, dtype=dtype, seed=2)
    got = fused_ops.rms_norm(x, w, 1e-5)
    assert torch.equal(got, fused_ops.rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 576), (9, 64), (64, 960), (3, 33)])
def test_residual_rms_norm_is_bit_identical(dtype, rows, n):
    h = _rand(rows, n, dtype=dtype, seed=3)
    residual = _rand(rows, n, dtype=dtype, seed=4, scale=10.0)
    w = _rand(n, dtype=dtype, seed=5)
    want_sum = residual + h
    want = fused_ops.rms_norm_ref(want_sum, w, 1e-6)
    got = fused_ops.rms_norm(h.clone(), w, 1e-6, residual=residual)
    assert torch.equal(residual, want_sum)  # updated in place
    assert torch.equal(got, want)


def test_rms_norm_of_a_strided_view():
    big = _rand(6, 300, dtype=torch.float32, seed=6)
    x = big[:, 10:138]  # rows 300 apart
    w = _rand(128, dtype=torch.float32, seed=7)
    assert torch.equal(fused_ops.rms_norm(x, w, 1e-5), fused_ops.rms_norm_ref(x, w, 1e-5))
    residual = _rand(6, 128, dtype=torch.float32, seed=8)
    want = fused_ops.rms_norm_ref(residual + x, w, 1e-5)
    got = fused_ops.rms_norm(x, w, 1e-5, residual=residual)  # written over the strided x
    assert torch.equal(got, want) and got.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 9, 64), (37, 3, 64), (5, 4, 128),
                                                   (2, 2, 6)])
def test_rope_in_place_is_bit_identical(dtype, tokens, heads, head_dim):
    kv_heads = 1
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=8, scale=2.0)
    positions = torch.arange(tokens) * 7 + 3
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + 1) * head_dim].view(tokens, kv_heads, head_dim)
    want_q, want_k = fused_ops.rope_ref(q, cos, sin), fused_ops.rope_ref(k, cos, sin)
    v_before = qkv[:, (heads + 1) * head_dim:].clone()
    fused_ops.rope_(q, cos, sin)
    fused_ops.rope_(k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + 1) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (4, 64), (3, 100), (2, 37), (16, 1536)])
def test_silu_and_mul_is_bit_identical(dtype, rows, n):
    # wide values reach exp's extremes (over- and underflow) as well as the usual range
    gate_up = _rand(rows, 2 * n, dtype=dtype, seed=9, scale=8.0)
    assert torch.equal(fused_ops.silu_and_mul(gate_up), fused_ops.silu_and_mul_ref(gate_up))


def test_fallback_without_native_library(monkeypatch):
    monkeypatch.setattr(fused_ops, "_native", lambda: None)
    x = _rand(3, 64, dtype=torch.float32, seed=10)
    residual = _rand(3, 64, dtype=torch.float32, seed=11)
    w = _rand(64, dtype=torch.float32, seed=12)
    want = fused_ops.rms_norm_ref(residual + x, w, 1e-5)
    assert torch.equal(fused_ops.rms_norm(x, w, 1e-5, residual=residual), want)
    gate_up = _rand(3, 128, dtype=torch.float32, seed=13)
    assert torch.equal(fused_ops.silu_and_mul(gate_up), fused_ops.silu_and_mul_ref(gate_up))


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, NaN where torch has NaN (its NaN payloads are its own: torch writes a
    canonical NaN, the kernels keep the quieted input's upper bits, as they always have)."""
    nan = want.isnan()
    bits = (lambda t: t.view(torch.int16)) if want.dtype == torch.bfloat16 else \
        (lambda t: t.view(torch.int32))
    return torch.equal(got.isnan(), nan) and torch.equal(bits(got)[~nan], bits(want)[~nan])


@pytest.mark.parametrize("special", ["denormal", "nan", "inf"])
def test_bfloat16_edge_values_keep_torchs_bits(special):
    """bfloat16 rows on AVX512-BF16 round with the instruction, which reads denormals as zero:
    blocks with denormals, NaN or inf take the exact path, so sums and products that land
    there keep torch's bits (and NaN stays where torch has it)."""
    value = {"denormal": 3e-39, "nan": float("nan"), "inf": float("inf")}[special]
    rows, n = 4, 576
    h = _rand(rows, n, dtype=torch.bfloat16, seed=14)
    residual = _rand(rows, n, dtype=torch.bfloat16, seed=15)
    h[1, 40:60] = value
    residual[1, 40:60] = 0
    h[2] = (torch.randn(n) * 1e-39).bfloat16()  # a row of denormals: its sum of squares is 0
    residual[2] = 0
    w = _rand(n, dtype=torch.bfloat16, seed=16)
    want_sum = residual + h
    want = fused_ops.rms_norm_ref(want_sum, w, 1e-6)
    got = fused_ops.rms_norm(h.clone(), w, 1e-6, residual=residual)
    assert _same(residual, want_sum)
    assert _same(got, want)
    tiny = (torch.randn(rows, n) * 1e-38).bfloat16()  # x * rsqrt lands near the denormals
    assert _same(fused_ops.rms_norm(tiny, w, 1e-30), fused_ops.rms_norm_ref(tiny, w, 1e-30))

    tokens, heads, head_dim = 5, 3, 64
    q = _rand(tokens, heads, head_dim, dtype=torch.bfloat16, seed=17)
    q[1, 2, 3:40] = value  # both halves of a head
    q[3] = (torch.randn(heads, head_dim) * 1e-37).bfloat16()  # products below the normals
    angles = torch.arange(tokens)[:, None] * torch.rand(head_dim, generator=torch.Generator()
                                                         .manual_seed(18))[None]
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    want = fused_ops.rope_ref(q, cos, sin)
    fused_ops.rope_(q, cos, sin)
    assert _same(q, want)


def _argmax_cases():
    """[rows, n] logits with what a greedy pick must get right: ties, NaNs, infinities, rows
    of -inf, signed zeros, and lengths around each build's steps (4 chains of one register's
    lanes: 16 elements on SSE2, 32 on AVX2, 64 on AVX-512)."""
    g = torch.Generator().manual_seed(11)
    cases = []
    for n in (1, 5, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 49152, 49157):
        x = torch.randn(8, n, generator=g)
        x[1] = (x[1] * 2).round()  # many ties
        x[2, torch.randint(0, n, (2,), generator=g)] = float("nan")
        x[3] = float("-inf")
        x[4, torch.randint(0, n, (1,), generator=g)] = float("inf")
        x[5] = 0.0
        x[5, n // 2] = -0.0
        x[6] = -0.0
        x[6, n - 1] = 0.0
        x[7] = 3.0  # every element the maximum
        cases.append(x)
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_is_torchs_first_maximum(dtype):
    for x in _argmax_cases():
        x = x.to(dtype)
        assert fused_ops.argmax_rows(x) == x.max(dim=-1).indices.tolist()
        view = torch.cat([x, x], dim=1)[:, 1:x.shape[1] + 1]  # rows 2n apart
        assert fused_ops.argmax_rows(view) == view.max(dim=-1).indices.tolist()


def test_argmax_rows_on_every_build_this_cpu_runs():
    # one register of lanes per build (AVX-512 16, AVX2 8, SSE2 4): each build agrees
    import ctypes

    from quire.native import loader
    builds = loader.isa_builds()
    assert builds  # an x86 CPU runs at least the plain build
    for march in builds:
        lib = loader.load_library("fused_ops.cpp", march)
        assert lib is not None, march
        fn = lib.quire_argmax_rows
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_void_p]
        for dtype, code in ((torch.float32, 0), (torch.bfloat16, 1)):
            for x in _argmax_cases():
                x = x.to(dtype)
                out = torch.empty(x.shape[0], dtype=torch.int64)
                assert fn(code, x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                          out.data_ptr()) == 0
                assert out.tolist() == x.max(dim=-1).indices.tolist(), (march, dtype)


def test_the_greedy_sampler_picks_with_it(monkeypatch):
    from quire.worker import sampler as sampler_module
    calls = []
    real = fused_ops.argmax_rows
    monkeypatch.setattr(fused_ops, "argmax_rows", lambda x: calls.append(x.shape) or real(x))
    logits = _rand(3, 49152, dtype=torch.bfloat16, seed=12)
    # what the greedy path reads of a SamplingBatch
    batch = type("Batch", (), {"spec_groups": None, "bitmask": None, "greedy": [True] * 3,
                               "logprobs": [None] * 3, "penalized": [False] * 3,
                               "banned_token_ids": [[]] * 3, "__len__": lambda self: 3})()
    out = sampler_module.Sampler(49152, torch.device("cpu"), 0)(logits, batch)
    assert calls == [(3, 49152)]
    assert out.token_ids == logits.max(dim=-1).indices.tolist()
