"""Weight-only int8 / int4 matmul for CUDA in Triton, on the canonical tensors
(quant_formats.py): y = x @ dequant(W).T.

Paths, picked by the number of rows M (measured on an H100 and an H200: benchmarks/README.md,
"Triton on a GPU"):
- `gemv` (M = 1: single-sequence decode): each program streams a [BLOCK_N, BLOCK_K] weight
  tile along K (coalesced), dequantizes it in registers and multiply-adds x into fp32
  accumulators, no tl.dot; short of programs to fill the GPU, K is split and the partial sums
  added in a fixed order (deterministic). int4 loads each byte once and splits its nibbles
  into the even and odd K positions.
- `fused-fast` (int8, M up to FUSED_MAX_M, fp16/bf16 x: batched decode): tiles dequantized in
  registers into tl.dot on tensor cores. `fused` is the same with fp32 products.
- `dequant` (int4 beyond one row; int8 prefill; fp32 x): a Triton kernel writes dequant(W)
  in x's dtype, then cuBLAS multiplies. Reading a byte and writing 2 per weight is cheap next
  to the GEMM there, and for int4 it beat the fused kernel at batched decode too.
Tiles wider than a quantization group load each row's scale (and zero) once per group and
broadcast it (_group_params), so K tiles are sized for bandwidth, not for the group.

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

from quire.layers import quant_formats as qf
from quire.layers.quant_kernel_base import Kernel

GEMV_MAX_M = 1          # rows of x the gemv path takes (at 8 it ran 2-4x slower than at 1)
FUSED_MAX_M = 64        # rows up to which fp16/bf16 x may take the fused tl.dot kernel
FUSED_MIN_N_INT8 = 8192  # int8 output columns below which dequantize + cuBLAS wins there
GEMV_MIN_PROGRAMS = 2   # per streaming multiprocessor: below it, K is split


def gemv_tiles(int4: bool, group: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the gemv: the fastest in benchmarks/cuda_quant_matmul.py's sweep
    on an H100 (Llama-3-8B's qkv and gate/up at M = 1): int8 8 x 1024 (73 us on gate/up,
    1.6 TB/s). int4 16 x 1024 on an H200 (gate/up, group 64: 97.5 us, 753 GB/s; 8 x 32, the
    best while a tile had to lie inside one group, took 199 us)."""
    return (16, 1024) if int4 else (8, 1024)


def pick_path(m: int, n: int, int4: bool, dtype: torch.dtype) -> str:
    """The measured winner per shape (benchmarks/README.md, "Triton on a GPU"): the gemv for
    one row. Beyond it, int8 with many output columns takes the fused kernel up to
    FUSED_MAX_M rows (with few, too few programs fill the GPU and dequantize + cuBLAS wins 2x
    on o_proj and down_proj). int4 dequantizes + cuBLAS from two rows: once its dequantize
    kernel stored contiguously it beat the fused kernel at every batched shape measured on an
    H200 (Llama-3-8B, M = 8: 33-185 us against 68-225; M = 64: 32-187 against 261-481).
    Prefill, and fp32 x (exact dequantized weights), dequantize + cuBLAS."""
    if m <= GEMV_MAX_M:
        return "gemv"
    if m <= FUSED_MAX_M and dtype != torch.float32 and not int4 and n >= FUSED_MIN_N_INT8:
        return "fused-fast"
    return "dequant"


@triton.jit
def _group_params(ptr, offs_n, idx, first, mask, stride_sn, n_groups, G: tl.constexpr,
                  TILE_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, B: tl.constexpr):
    """Per-group values (scales or zeros) for the weights at positions `idx` [1, B] of rows
    offs_n (K positions, or int4 bytes: two K positions each). TILE_GROUPS says how the
    tile's B positions, from `first` (the K position of the first), meet the groups:
    1: all in one group, one value per row ([BLOCK_N, 1]); above 1: that many whole groups,
    one load per row and group, broadcast over the group's positions ([BLOCK_N, B]); 0: any
    other way, one (cached) load per weight."""
    # one return statement: compiled Triton checks every return's type, taken or not
    if TILE_GROUPS == 1:
        values = tl.load(ptr + offs_n * stride_sn + first // G)[:, None]
    elif TILE_GROUPS > 1:
        # per-weight loads of the same few values held an H100 to 36 GB/s (benchmarks/HISTORY.md)
        g = first // G + tl.arange(0, TILE_GROUPS)
        per_group = tl.load(ptr + offs_n[:, None] * stride_sn + g[None, :],
                            mask=g[None, :] < n_groups, other=0.0)
        values = tl.reshape(tl.broadcast_to(per_group[:, :, None],
                                            (BLOCK_N, TILE_GROUPS, B // TILE_GROUPS)),
                            (BLOCK_N, B))
    else:
        values = tl.load(ptr + offs_n[:, None] * stride_sn + idx // G, mask=mask, other=0.0)
    return values


@triton.jit
def _int8_tile(q_ptr, s_ptr, offs_n, offs_k, k0, mask, stride_qn, stride_sn, n_groups,
               G: tl.constexpr, TILE_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] fp32 weights (offs_n in bounds: masked rows are clamped)."""
    s = _group_params(s_ptr, offs_n, offs_k[None, :], k0, mask, stride_sn, n_groups, G,
                      TILE_GROUPS, BLOCK_N, BLOCK_K)
    q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=mask, other=0)
    return tl.where(mask, q.to(tl.float32) * s, 0.0)


@triton.jit
def _int4_pair(q_ptr, s_ptr, z_ptr, offs_n, offs_b, b0, mask, stride_qn, stride_sn, n_groups,
               G: tl.constexpr, TILE_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_B: tl.constexpr):
    """The weights at even and odd K positions of bytes offs_b ([BLOCK_N, BLOCK_B] fp32
    each): every byte is loaded once, its two nibbles split; both share a group (G even)."""
    byte = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_b[None, :], mask=mask, other=0)
    byte = byte.to(tl.int32)
    k_even = 2 * offs_b[None, :]
    s = _group_params(s_ptr, offs_n, k_even, 2 * b0, mask, stride_sn, n_groups, G, TILE_GROUPS,
                      BLOCK_N, BLOCK_B)
    z = _group_params(z_ptr, offs_n, k_even, 2 * b0, mask, stride_sn, n_groups, G, TILE_GROUPS,
                      BLOCK_N, BLOCK_B)
    even = ((byte & 0xF).to(tl.float32) - 8.0) * s + z
    odd = ((byte >> 4).to(tl.float32) - 8.0) * s + z
    return tl.where(mask, even, 0.0), tl.where(mask, odd, 0.0)


@triton.jit
def _int4_operands(x_rows, q_ptr, s_ptr, z_ptr, offs_m, M, offs_n, offs_n_safe, N, k0, k_end,
                   stride_qn, stride_sn, n_groups, G: tl.constexpr, TILE_GROUPS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A K tile of int4 weights as (x_even, x_odd, w_even, w_odd): x's values at the even and
    odd K positions below k_end, and the weights those multiply ([BLOCK_N, BLOCK_K // 2])."""
    offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    in_k = 2 * offs_b < k_end  # K and k_end are even: a byte never straddles k_end
    w_even, w_odd = _int4_pair(q_ptr, s_ptr, z_ptr, offs_n_safe, offs_b, k0 // 2,
                               (offs_n[:, None] < N) & in_k[None, :], stride_qn, stride_sn,
                               n_groups, G, TILE_GROUPS, BLOCK_N, BLOCK_K // 2)
    x_mask = (offs_m[:, None] < M) & in_k[None, :]
    x_even = tl.load(x_rows + 2 * offs_b[None, :], mask=x_mask, other=0.0)
    x_odd = tl.load(x_rows + 2 * offs_b[None, :] + 1, mask=x_mask, other=0.0)
    return x_even, x_odd, w_even, w_odd


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, K_PER_SPLIT,
                 stride_xm, stride_qn, stride_sn, stride_ys, stride_ym,
                 G: tl.constexpr, INT4: tl.constexpr, TILE_GROUPS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    # the clamp keeps masked-off rows' addresses in bounds; the mask drops their values
    offs_n_safe = tl.minimum(offs_n, N - 1)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if INT4:
            x_even, x_odd, w_even, w_odd = _int4_operands(
                x_rows, q_ptr, s_ptr, z_ptr, offs_m, M, offs_n, offs_n_safe, N, k0, k_end,
                stride_qn, stride_sn, K // G, G, TILE_GROUPS, BLOCK_N, BLOCK_K)
            acc += tl.sum(x_even.to(tl.float32)[:, None, :] * w_even[None, :, :], axis=2)
            acc += tl.sum(x_odd.to(tl.float32)[:, None, :] * w_odd[None, :, :], axis=2)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            in_k = offs_k < k_end
            w = _int8_tile(q_ptr, s_ptr, offs_n_safe, offs_k, k0,
                           (offs_n[:, None] < N) & in_k[None, :], stride_qn, stride_sn,
                           K // G, G, TILE_GROUPS, BLOCK_N, BLOCK_K)
            x = tl.load(x_rows + offs_k[None, :], mask=(offs_m[:, None] < M) & in_k[None, :],
                        other=0.0)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    tl.store(y_ptr + split * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn,
                       G: tl.constexpr, INT4: tl.constexpr, TILE_GROUPS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rows = w_ptr + offs_n[:, None] * stride_wn
    offs_n_safe = tl.minimum(offs_n, N - 1)
    if INT4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = (offs_n[:, None] < N) & (2 * offs_b[None, :] < K)
        w_even, w_odd = _int4_pair(q_ptr, s_ptr, z_ptr, offs_n_safe, offs_b, k0 // 2, mask,
                                   stride_qn, stride_sn, K // G, G, TILE_GROUPS, BLOCK_N,
                                   BLOCK_K // 2)
        # even and odd interleaved in registers, then one contiguous store: two stores of
        # every other element held an H100/H200 to ~40 GB/s
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.reshape(tl.join(w_even, w_odd), (BLOCK_N, BLOCK_K))
        tl.store(rows + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        w = _int8_tile(q_ptr, s_ptr, offs_n_safe, offs_k, k0, mask, stride_qn, stride_sn,
                       K // G, G, TILE_GROUPS, BLOCK_N, BLOCK_K)
        tl.store(rows + offs_k[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K,
                  stride_xm, stride_qn, stride_sn, stride_ym,
                  G: tl.constexpr, INT4: tl.constexpr, TILE_GROUPS: tl.constexpr,
                  DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n_safe = tl.minimum(offs_n, N - 1)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if INT4:  # two dots of half the depth: even K positions, then odd ones
            x_even, x_odd, w_even, w_odd = _int4_operands(
                x_rows, q_ptr, s_ptr, z_ptr, offs_m, M, offs_n, offs_n_safe, N, k0, K,
                stride_qn, stride_sn, K // G, G, TILE_GROUPS, BLOCK_N, BLOCK_K)
            if DOT_FP32:
                acc += tl.dot(x_even.to(tl.float32), tl.trans(w_even), input_precision="ieee")
                acc += tl.dot(x_odd.to(tl.float32), tl.trans(w_odd), input_precision="ieee")
            else:
                acc += tl.dot(x_even, tl.trans(w_even.to(x_even.dtype)))
                acc += tl.dot(x_odd, tl.trans(w_odd.to(x_odd.dtype)))
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            in_k = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=(offs_m[:, None] < M) & in_k[None, :],
                        other=0.0)
            w = tl.trans(_int8_tile(q_ptr, s_ptr, offs_n_safe, offs_k, k0,
                                    (offs_n[:, None] < N) & in_k[None, :], stride_qn,
                                    stride_sn, K // G, G, TILE_GROUPS, BLOCK_N, BLOCK_K))
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


def _tile_groups(group: int, k: int, block_k: int) -> int:
    """How the K tiles (aligned to block_k) meet the groups, for _group_params: 1 when each
    lies in one group, block_k // group when each holds that many whole groups (a power of
    two), else 0 (per-weight loads)."""
    if group % block_k == 0 or group == k:
        return 1
    if block_k % group == 0 and (block_k // group) & (block_k // group - 1) == 0:
        return block_k // group
    return 0


def _shapes(x, qweight, scales):
    m, k = x.shape
    n = qweight.shape[0]
    return m, n, k, k // scales.shape[1]


def gemv(x: torch.Tensor, qweight, scales, zeros=None, *, block_n: int | None = None,
         block_k: int | None = None, split_k: int | None = None,
         num_warps: int = 4) -> torch.Tensor:
    """Up to 8 rows of x (the tiles are sized for one)."""
    x = x.contiguous()
    m, n, k, group = _shapes(x, qweight, scales)
    if m > 8:
        raise ValueError(f"the gemv takes at most 8 rows of x, got {m}")
    default_n, default_k = gemv_tiles(zeros is not None, group)
    block_n = block_n or default_n
    block_k = min(block_k or default_k, triton.next_power_of_2(k))
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
        G=group, INT4=int4, TILE_GROUPS=_tile_groups(group, k, block_k),
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps)
    if split_k == 1:
        return out[0]
    return out.sum(0).to(x.dtype)  # fixed order: the same bits every run


def dequantize(qweight, scales, zeros=None, dtype=torch.float32, *,
               block_k: int | None = None) -> torch.Tensor:
    """dequant(W) [N, K] in `dtype` (each fp32 value rounded to it once)."""
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if zeros is not None else 1)
    group = k // scales.shape[1]
    w = torch.empty(n, k, device=qweight.device, dtype=dtype)
    # a tile that spans whole groups loads each row's scale (and zero) once per group
    # (_group_params): per-weight loads of them held an H100 to 36 GB/s
    int4 = zeros is not None
    # 256: the fastest K tile on an H200 (int4 gate/up, group 64: 105 us, 699 GB/s of int4
    # weights; 118 at 128, 321 at 32)
    block_k = min(block_k or 256, triton.next_power_of_2(k))
    block_n = 4096 // block_k
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros if int4 else scales, w, n, k, qweight.stride(0),
        scales.stride(0), w.stride(0), G=group, INT4=int4,
        TILE_GROUPS=_tile_groups(group, k, block_k),
        BLOCK_N=block_n, BLOCK_K=block_k)
    return w


def fused_tiles(int4: bool, m: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the fused kernel. int4: the fastest in
    benchmarks/cuda_quant_matmul.py's sweep on an H200 (gate/up, group 64, bf16 x): 64 x 256
    at M = 8 (185 us; 297 at 64 x 32), 128 x 128 at M = 32 (331 us; 588 at 64 x 32). int8:
    64 x 32, not swept."""
    if not int4:
        return 64, 32
    return (64, 256) if m <= 16 else (128, 128)


def fused(x: torch.Tensor, qweight, scales, zeros=None, fast: bool = False, *,
          block_m: int | None = None, block_n: int | None = None,
          block_k: int | None = None, num_warps: int = 4) -> torch.Tensor:
    x = x.contiguous()
    m, n, k, group = _shapes(x, qweight, scales)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    int4 = zeros is not None
    default_n, default_k = fused_tiles(int4, m)
    block_n = block_n or default_n
    # no wider than K needs, and at least 32: int4's dots take half of it, tl.dot at least 16
    block_k = min(block_k or default_k, max(32, triton.next_power_of_2(k)))
    _fused_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, qweight, scales, zeros if int4 else scales, y, m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        G=group, INT4=int4, TILE_GROUPS=_tile_groups(group, k, block_k),
        DOT_FP32=not fast or x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None = None, path: str = "auto") -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16) @ dequant(W).T -> [M, N] in x's dtype; int4 when `zeros`
    is given (qweight then [N, K//2]). path: auto, gemv, dequant, fused, fused-fast."""
    if path == "auto":
        path = pick_path(x.shape[0], qweight.shape[0], zeros is not None, x.dtype)
    if path == "gemv":
        return gemv(x, qweight, scales, zeros)
    if path == "dequant":
        return x @ dequantize(qweight, scales, zeros, x.dtype).T
    if path in ("fused", "fused-fast"):
        return fused(x, qweight, scales, zeros, fast=path == "fused-fast")
    raise ValueError(f"path must be auto, gemv, dequant, fused or fused-fast, got {path!r}")


class TritonQuantKernel(Kernel):
    """The quant_kernel_base.Kernel for CUDA weights: reads the layer's canonical tensors."""

    def __init__(self, kind: str, qweight, scales, zeros=None) -> None:
        self.name = f"triton-{kind}"
        self.qweight, self.scales = qweight.contiguous(), scales.float().contiguous()
        self.zeros = None if zeros is None else zeros.float().contiguous()

    def dequantize(self) -> torch.Tensor:
        if self.zeros is None:
            return qf.dequantize_int8(self.qweight, self.scales)
        return qf.dequantize_int4(self.qweight, self.scales, self.zeros)

    def __call__(self, x):
        return quant_matmul(x, self.qweight, self.scales, self.zeros)


def kernel(kind: str, qweight, scales, zeros=None) -> TritonQuantKernel:
    return TritonQuantKernel(kind, qweight, scales, zeros)
