"""Weight-only int8 / int4 matmul for CUDA in Triton, on the canonical tensors
(quant_formats.py): y = x @ dequant(W).T.

Three paths, picked by the number of rows M (measured on an H100: benchmarks/README.md,
"Weight-only quantization on a GPU"):
- `gemv` (M <= GEMV_MAX_M: decode): each program streams a [BLOCK_N, BLOCK_K] weight tile
  along K (coalesced), dequantizes it in registers and multiply-adds every row of x into fp32
  accumulators, no tl.dot; short of programs to fill the GPU, K is split and the partial sums
  added in a fixed order (deterministic). Memory-bound, as decode is.
- `dequant` (larger M: prefill): a Triton kernel writes dequant(W) in x's dtype, then cuBLAS
  multiplies. Reading 1 byte and writing 2 per weight is cheap next to the GEMM at these M.
- `fused`: the weight dequantized tile by tile into tl.dot (kept for the benchmark's sweep).

Precision: gemv and fused(ieee) multiply in fp32, so they equal dequantize-then-matmul up to
the order of the sums; dequant and fused(fast) round each dequantized weight to x's dtype
first (about one half-precision ulp per weight; exact for fp32 activations). Tested in
TRITON_INTERPRET=1 against dequantize-then-matmul (tests/quant/triton_quant_suite.py) and
compiled on a GPU (benchmarks/cuda_check.sh); bf16 tl.dot is wrong in the interpreter, so
the interpreter cases use fp32 and fp16.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

GEMV_MAX_M = 8          # rows of x up to which the gemv path runs
GEMV_BLOCK_N = 16       # output columns per gemv program
GEMV_BLOCK_K = 256      # weights per row per gemv step (128 bytes of int4, 256 of int8)
GEMV_MIN_PROGRAMS = 2   # per streaming multiprocessor: below it, K is split


@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n, offs_k, k0, mask, stride_qn, stride_sn,
                  G: tl.constexpr, INT4: tl.constexpr, TILE_GROUP: tl.constexpr):
    """[BLOCK_N, BLOCK_K] fp32 weights; offs_n must be in bounds (masked rows clamped).
    TILE_GROUP: the tile lies in one group (BLOCK_K divides the group size, or one group
    spans K), so each row loads one scale, not one per weight. G is a compile-time constant
    so that the compiler sees scales repeat along K."""
    if TILE_GROUP:
        s = tl.load(s_ptr + offs_n * stride_sn + k0 // G)[:, None]
    else:
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_k[None, :] // G, mask=mask,
                    other=0.0)
    if INT4:
        byte = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] // 2, mask=mask,
                       other=0)
        q = (byte.to(tl.int32) >> ((offs_k[None, :] % 2) * 4)) & 0xF
        if TILE_GROUP:
            z = tl.load(z_ptr + offs_n * stride_sn + k0 // G)[:, None]
        else:
            z = tl.load(z_ptr + offs_n[:, None] * stride_sn + offs_k[None, :] // G, mask=mask,
                        other=0.0)
        w = (q.to(tl.float32) - 8.0) * s + z
    else:
        q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=mask, other=0)
        w = q.to(tl.float32) * s
    return tl.where(mask, w, 0.0)


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, K_PER_SPLIT,
                 stride_xm, stride_qn, stride_sn, stride_ys, stride_ym,
                 G: tl.constexpr, INT4: tl.constexpr, TILE_GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # the clamp keeps masked-off rows' addresses in bounds; the mask drops their values
    offs_n_safe = tl.minimum(offs_n, N - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < k_end)
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, offs_n_safe, offs_k, k0, mask, stride_qn,
                          stride_sn, G, INT4, TILE_GROUP)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_end), other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    tl.store(y_ptr + split * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn,
                       G: tl.constexpr, INT4: tl.constexpr, TILE_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    w = _dequant_tile(q_ptr, s_ptr, z_ptr, tl.minimum(offs_n, N - 1), offs_k, k0, mask,
                      stride_qn, stride_sn, G, INT4, TILE_GROUP)
    tl.store(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
             w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K,
                  stride_xm, stride_qn, stride_sn, stride_ym,
                  G: tl.constexpr, INT4: tl.constexpr, TILE_GROUP: tl.constexpr, DOT_FP32: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_safe = tl.minimum(offs_n, N - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        w = tl.trans(_dequant_tile(q_ptr, s_ptr, z_ptr, offs_n_safe, offs_k, k0, mask,
                                   stride_qn, stride_sn, G, INT4, TILE_GROUP))
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_programs_wanted(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: splitting is still exercised by tests passing split_k
    return GEMV_MIN_PROGRAMS * _sm_count(device.index if device.index is not None
                                         else torch.cuda.current_device())


def _tile_group(group: int, k: int, block_k: int) -> bool:
    """Every K tile (aligned to block_k) lies inside one group."""
    return group % block_k == 0 or group == k


def _shapes(x, qweight, scales):
    m, k = x.shape
    n = qweight.shape[0]
    return m, n, k, k // scales.shape[1]


def gemv(x: torch.Tensor, qweight, scales, zeros=None, *, block_n: int = GEMV_BLOCK_N,
         block_k: int = GEMV_BLOCK_K, split_k: int | None = None,
         num_warps: int = 4) -> torch.Tensor:
    x = x.contiguous()
    m, n, k, group = _shapes(x, qweight, scales)
    block_k = min(block_k, triton.next_power_of_2(k))
    programs = triton.cdiv(n, block_n)
    if split_k is None:  # enough (column block, K slice) programs to fill the GPU
        split_k = max(1, min(triton.cdiv(_num_programs_wanted(x.device), programs),
                             k // (4 * block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(split_k, m, n, device=x.device,
                      dtype=x.dtype if split_k == 1 else torch.float32)
    int4 = zeros is not None
    _gemv_kernel[(programs, split_k)](
        x, qweight, scales, zeros if int4 else scales, out, m, n, k, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1),
        G=group, INT4=int4, TILE_GROUP=_tile_group(group, k, block_k),
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps)
    if split_k == 1:
        return out[0]
    return out.sum(0).to(x.dtype)  # fixed order: the same bits every run


def dequantize(qweight, scales, zeros=None, dtype=torch.float32) -> torch.Tensor:
    """dequant(W) [N, K] in `dtype` (each fp32 value rounded to it once)."""
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if zeros is not None else 1)
    group = k // scales.shape[1]
    w = torch.empty(n, k, device=qweight.device, dtype=dtype)
    block_n, block_k = 32, min(128, triton.next_power_of_2(k))
    int4 = zeros is not None
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros if int4 else scales, w, n, k, qweight.stride(0),
        scales.stride(0), w.stride(0), G=group, INT4=int4,
        TILE_GROUP=_tile_group(group, k, block_k),
        BLOCK_N=block_n, BLOCK_K=block_k)
    return w


def fused(x: torch.Tensor, qweight, scales, zeros=None, fast: bool = False, *,
          block_m: int | None = None, block_n: int = 64, block_k: int = 32,
          num_warps: int = 4) -> torch.Tensor:
    x = x.contiguous()
    m, n, k, group = _shapes(x, qweight, scales)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    int4 = zeros is not None
    _fused_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, qweight, scales, zeros if int4 else scales, y, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        G=group, INT4=int4, TILE_GROUP=_tile_group(group, k, block_k),
        DOT_FP32=not fast or x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None = None, path: str = "auto") -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16) @ dequant(W).T -> [M, N] in x's dtype; int4 when `zeros`
    is given (qweight then [N, K//2]). path: auto, gemv, dequant, fused, fused-fast."""
    if path == "auto":
        path = "gemv" if x.shape[0] <= GEMV_MAX_M else "dequant"
    if path == "gemv":
        return gemv(x, qweight, scales, zeros)
    if path == "dequant":
        return x @ dequantize(qweight, scales, zeros, x.dtype).T
    if path in ("fused", "fused-fast"):
        return fused(x, qweight, scales, zeros, fast=path == "fused-fast")
    raise ValueError(f"path must be auto, gemv, dequant, fused or fused-fast, got {path!r}")


class TritonQuantKernel:
    """The quant_kernels.Kernel for CUDA weights."""

    def __init__(self, kind: str, qweight, scales, zeros=None) -> None:
        self.name = f"triton-{kind}"
        self.qweight, self.scales = qweight.contiguous(), scales.float().contiguous()
        self.zeros = None if zeros is None else zeros.float().contiguous()

    def __call__(self, x):
        return quant_matmul(x, self.qweight, self.scales, self.zeros)


def kernel(kind: str, qweight, scales, zeros=None) -> TritonQuantKernel:
    return TritonQuantKernel(kind, qweight, scales, zeros)
