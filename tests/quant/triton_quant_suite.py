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
from quire.layers import triton_quant  # noqa: E402
from quire.layers.triton_quant import quant_matmul  # noqa: E402

from quant_helpers import matmul_error_bound  # noqa: E402


def quantized(kind: str, group: int | None, n: int, k: int):
    w = torch.randn(n, k)
    if kind == "int8":
        q, s = qf.quantize_int8(w, group)
        return (q, s, None), qf.dequantize_int8(q, s)
    q, s, z = qf.quantize_int4(w, group)
    return (q, s, z), qf.dequantize_int4(q, s, z)


def on_device(*tensors):
    return [t.to(DEVICE_TYPE) if t is not None else None for t in tensors]


def assert_within_bound(got, x, dense, dtype, rounds_weights: bool):
    want = x.float() @ dense.T
    # a path that rounds each weight to x's dtype first: one half-precision ulp each
    rounding = torch.finfo(dtype).eps if rounds_weights and dtype != torch.float32 else 0.0
    bound = matmul_error_bound(x.float(), dense, dtype, weight_rounding=rounding)
    excess = (got.float() - want).abs() - bound
    assert (excess <= 0).all(), f"off by up to {excess.max().item():.3g} beyond the bound"


# (kind, group, K): per-channel int8 on a K that is no power of two, small groups (48: no
# power of two, so no tile holds whole groups: per-weight scale loads), and int4 groups
# below, at and above the kernels' K tiles
WEIGHTS = [("int8", None, 128), ("int8", None, 192), ("int8", 16, 128), ("int8", 48, 192),
           ("int4", 32, 128), ("int4", 64, 192), ("int4", 128, 512)]
# (dtype, path, rows of x): the gemv at one row and at its most; the others at a partial and
# a multiple-tile M
PATHS = [(torch.float32, "gemv", 1), (torch.float16, "gemv", 5), (torch.float32, "dequant", 5),
         (torch.float16, "dequant", 33), (torch.float32, "fused", 33),
         (torch.float16, "fused", 5), (torch.float16, "fused-fast", 33)]


@pytest.mark.parametrize("kind,group,k", WEIGHTS)
@pytest.mark.parametrize("dtype,path,m", PATHS)
def test_triton_matches_dequantize_then_matmul(kind, group, k, dtype, path, m):
    torch.manual_seed(m)
    n = 72
    (q, s, z), dense = quantized(kind, group, n, k)
    x = torch.randn(m, k).to(dtype)
    got = quant_matmul(*on_device(x, q, s, z), path=path).cpu()
    assert got.dtype == dtype and got.shape == (m, n)
    assert_within_bound(got, x, dense, dtype, rounds_weights=path in ("dequant", "fused-fast"))


@pytest.mark.parametrize("kind,group,k", [("int8", None, 576), ("int4", 32, 512)])
@pytest.mark.parametrize("split_k,block_k", [(2, 64), (3, 64), (5, 32)])
def test_gemv_split_k_sums_the_slices_in_order(kind, group, k, split_k, block_k):
    """K split across programs (slices of whole K tiles; the last one short), the partial
    sums added after: the same result within the bound, and the same bits every run."""
    torch.manual_seed(split_k)
    (q, s, z), dense = quantized(kind, group, 40, k)
    x = torch.randn(3, k)
    args = on_device(x, q, s, z)
    got = triton_quant.gemv(*args, block_n=16, block_k=block_k, split_k=split_k).cpu()
    assert_within_bound(got, x, dense, torch.float32, rounds_weights=False)
    again = triton_quant.gemv(*args, block_n=16, block_k=block_k, split_k=split_k).cpu()
    assert torch.equal(got, again)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_auto_path_at_every_row_count_boundary(dtype):
    """gemv for one row; dequantize + matmul beyond it (int4)."""
    torch.manual_seed(0)
    (q, s, z), dense = quantized("int4", 32, 24, 64)
    for m in (1, 2, triton_quant.FUSED_MAX_M, triton_quant.FUSED_MAX_M + 1):
        x = torch.randn(m, 64).to(dtype)
        got = quant_matmul(*on_device(x, q, s, z)).cpu()
        assert_within_bound(got, x, dense, dtype, rounds_weights=m > 1)


def test_auto_path_follows_the_measured_winners():
    pick = triton_quant.pick_path
    bf16, fp32 = torch.bfloat16, torch.float32
    assert pick(1, 4096, False, bf16) == pick(1, 4096, True, fp32) == "gemv"
    assert pick(8, 28672, False, bf16) == "fused-fast"   # int8, many columns
    assert pick(8, 4096, False, bf16) == "dequant"       # int8, few columns
    assert pick(2, 28672, True, bf16) == "dequant"       # int4: dequantize + cuBLAS
    assert pick(64, 4096, True, bf16) == "dequant"
    assert pick(65, 28672, True, bf16) == "dequant"      # prefill
    assert pick(8, 28672, False, fp32) == "dequant"      # fp32: exact weights, IEEE GEMM


def test_gemv_refuses_more_rows_than_it_is_built_for():
    (q, s, z), _ = quantized("int8", None, 8, 32)
    with pytest.raises(ValueError, match="at most 8 rows"):
        triton_quant.gemv(*on_device(torch.randn(9, 32), q, s, z))


def test_dequantize_kernel_writes_the_reference_values():
    """int8: q * s, one rounding, the same bits. int4: (q - 8) * s + z may be one fused
    multiply-add on a GPU (one rounding where the reference has two), so within an ulp."""
    torch.manual_seed(1)
    for kind, group in (("int8", None), ("int8", 32), ("int4", 32), ("int4", 128)):
        (q, s, z), dense = quantized(kind, group, 50, 256)
        for dtype in (torch.float32, torch.float16):
            got = triton_quant.dequantize(*on_device(q, s, z), dtype=dtype).cpu()
            want = dense.to(dtype)
            if kind == "int8":
                assert torch.equal(got, want), (kind, group, dtype)
            else:
                eps = torch.finfo(dtype).eps
                torch.testing.assert_close(got, want, rtol=eps, atol=eps * dense.abs().max())


@pytest.mark.parametrize("group,k", [(32, 512), (64, 192)])
@pytest.mark.parametrize("block_k", [64, 256])
def test_tiles_of_several_whole_groups_load_each_groups_scale_once(group, k, block_k):
    """A K tile spanning 2-8 groups (the last one past K on K = 192: its scales are masked):
    every path gives the reference values within the bound."""
    # the case takes the whole-groups branch, not the per-weight loads
    assert triton_quant._tile_groups(group, k, block_k) == block_k // group
    torch.manual_seed(block_k + group)
    (q, s, z), dense = quantized("int4", group, 40, k)
    x = torch.randn(1, k)
    got = triton_quant.gemv(*on_device(x, q, s, z), block_n=16, block_k=block_k).cpu()
    assert_within_bound(got, x, dense, torch.float32, rounds_weights=False)
    x = torch.randn(5, k).to(torch.float16)
    got = triton_quant.fused(*on_device(x, q, s, z), block_k=block_k).cpu()
    assert_within_bound(got, x, dense, torch.float16, rounds_weights=False)
    got = triton_quant.dequantize(*on_device(q, s, z), block_k=block_k).cpu()
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(got, dense, rtol=eps, atol=eps * dense.abs().max())


def test_unknown_path_is_a_clear_error():
    (q, s, z), _ = quantized("int8", None, 8, 32)
    with pytest.raises(ValueError, match="path must be auto, gemv, dequant"):
        quant_matmul(*on_device(torch.randn(1, 32), q, s, z), path="cublas")


@pytest.mark.parametrize("kind,group", [("int8", None), ("int4", 32)])
def test_the_engine_kernel_object_is_a_quant_kernel(kind, group):
    """What a quantized linear layer holds on CUDA: picked by quant_kernels, reading the
    layer's own tensors (the canonical ones stay), dequantizing to the reference values."""
    from quire.layers import quant_kernels
    torch.manual_seed(2)
    (q, s, z), dense = quantized(kind, group, 40, 128)
    q, s, z = on_device(q, s, z)
    kernel = (quant_kernels.int8_kernel(q, s, prefer="triton") if kind == "int8"
              else quant_kernels.int4_kernel(q, s, z, prefer="triton"))
    assert isinstance(kernel, quant_kernels.Kernel) and kernel.name == f"triton-{kind}"
    assert not kernel.owns_weights and kernel.extra_bytes() == 0
    assert torch.equal(kernel.dequantize().cpu(), dense)
    x = torch.randn(3, 128)
    assert_within_bound(kernel(x.to(DEVICE_TYPE)).cpu(), x, dense, torch.float32,
                        rounds_weights=False)
