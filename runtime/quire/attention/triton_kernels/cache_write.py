"""Cache write: each new token's K and V go to their slot in the paged cache.

fp8 caches store value / scale, rounded to nearest-even and saturated at the format's
largest finite value. The rounding is done with integer arithmetic before the cast, so the
cast itself is exact: Triton's CPU interpreter rounds fp8 casts half-up without carrying
into the exponent (1.98 becomes 1.0), and this way the GPU and the interpreter store the
same bytes as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quire.attention.triton_kernels.common import padded_head_dim

# fp8 format -> (mantissa bits, smallest normal exponent, largest finite value)
_FP8_FORMATS = {
    torch.float8_e4m3fn: (3, -6, 448.0),
    torch.float8_e5m2: (2, -14, 57344.0),
}


@triton.jit
def round_to_fp8_grid(x, DROP_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                      SUBNORMAL_MAGIC: tl.constexpr, MAX_FINITE: tl.constexpr):
    """fp32 -> the nearest value an fp8 format holds (ties to even), still in fp32."""
    x = tl.minimum(tl.maximum(x, -MAX_FINITE), MAX_FINITE)
    bits = x.to(tl.int32, bitcast=True)
    # normal range: round the fp32 mantissa to the fp8 width; a carry bumps the exponent
    half_minus_one = (1 << (DROP_BITS - 1)) - 1
    bits = (bits + half_minus_one + ((bits >> DROP_BITS) & 1)) & -(1 << DROP_BITS)
    normal = bits.to(tl.float32, bitcast=True)
    # subnormal range: fixed spacing, which is the fp32 ulp of SUBNORMAL_MAGIC, so the add
    # rounds to it (ties to even) and the subtraction is exact
    small = (tl.abs(x) + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC
    # x's sign bit, or'ed in: -small is 0 - small on a GPU, which turns -0.0 into +0.0
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    small = (small.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < MIN_NORMAL, small, normal)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_tokens, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_token, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANTIZE: tl.constexpr,
    DROP_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr,
    MAX_FINITE: tl.constexpr,
):
    # a tile of BLOCK_T tokens x (every KV head, head_dim): one column per (head, dim)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.arange(0, BLOCK_H * BLOCK_D)
    h = col // BLOCK_D
    d = col % BLOCK_D
    t_valid = t < num_tokens
    mask = t_valid[:, None] & ((h < NUM_KV_HEADS) & (d < HEAD_DIM))[None, :]
    slot = tl.load(slot_mapping_ptr + t, mask=t_valid, other=0)
    dst = (((slot // BLOCK_SIZE) * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_token)[:, None]
           + (h * stride_cache_head + d)[None, :])
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + t64 * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    if QUANTIZE:
        # div_rn: IEEE division, as torch divides; `/` is ~2 ulps on a GPU, enough to move
        # a value across an fp8 rounding boundary
        k = round_to_fp8_grid(tl.math.div_rn(k.to(tl.float32), k_scale), DROP_BITS,
                              MIN_NORMAL, SUBNORMAL_MAGIC, MAX_FINITE)
        v = round_to_fp8_grid(tl.math.div_rn(v.to(tl.float32), v_scale), DROP_BITS,
                              MIN_NORMAL, SUBNORMAL_MAGIC, MAX_FINITE)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# elements per program: a few per thread on a GPU, and few programs in the interpreter
_TILE_ELEMENTS = 4096


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k/v [T, Hkv, D] (any strides with a unit last one) into caches
    [num_blocks, block_size, Hkv, D] at slot_mapping [T]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share a layout")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the head dimension must be contiguous")
    quantize = k_cache.dtype != k.dtype
    if quantize and k_cache.dtype not in _FP8_FORMATS:
        raise ValueError(f"KV cache dtype {k_cache.dtype} differs from the activations "
                         f"({k.dtype}) and is not an fp8 format")
    mantissa, min_exp, max_finite = _FP8_FORMATS.get(k_cache.dtype, (3, -6, 448.0))
    block_h, block_d = triton.next_power_of_2(num_kv_heads), padded_head_dim(head_dim)
    block_t = max(1, _TILE_ELEMENTS // (block_h * block_d))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_cache, v_cache, slot_mapping, num_tokens, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, QUANTIZE=quantize,
        DROP_BITS=23 - mantissa, MIN_NORMAL=2.0 ** min_exp,
        SUBNORMAL_MAGIC=2.0 ** (min_exp - mantissa + 23), MAX_FINITE=max_finite,
    )
