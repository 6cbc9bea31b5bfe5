"""Pieces every attention kernel shares: reading K/V tiles through the block table, the
dtype that tl.dot multiplies in, and tile sizes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634   # kernels use exp2: scores are scaled by log2(e) up front

# Activations -> (dtype of tl.dot operands, input_precision).
# fp32 asks for "ieee" so a GPU doesn't quietly drop to TF32: float32 serving exists to match
# the reference token for token. bf16 multiplies natively on a GPU (tensor cores at the bf16
# rate, P rounded to bf16 as the torch reference rounds it; benchmarks/cuda_check.sh runs the
# kernel suite compiled there). Triton's CPU interpreter multiplies bf16 operands as raw
# integers, so there bf16 tiles are upcast to fp32 ("tf32" holds a bf16 operand exactly).
_DOT = {
    torch.float32: (tl.float32, "ieee"),
    torch.float16: (tl.float16, None),     # the default: fp16 operands have no variants
    torch.bfloat16: (tl.bfloat16, None),
}
_DOT_INTERPRETED = {**_DOT, torch.bfloat16: (tl.float32, "tf32")}


def dot_config(dtype: torch.dtype):
    if dtype not in _DOT:
        raise ValueError(f"triton attention supports float32, float16 and bfloat16 "
                         f"activations, got {dtype}")
    return (_DOT_INTERPRETED if is_interpreted(kv_tile_offsets) else _DOT)[dtype]


def padded_head_dim(head_dim: int) -> int:
    """tl.arange needs a power of two, and tl.dot on a GPU a reduction of at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def is_interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


@triton.jit
def kv_tile_offsets(block_table_row_ptr, pos, valid, kv_head, stride_cache_block,
                    stride_cache_token, stride_cache_head, BLOCK_SIZE: tl.constexpr):
    """Offsets of the rows (head kv_head, from dim 0) of token positions `pos` in a paged
    cache. Each position looks up its own block, so a tile may span several cache blocks and
    tile sizes don't depend on the block size, however small."""
    block = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
    return (block.to(tl.int64) * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_token
            + kv_head * stride_cache_head)


@triton.jit
def softcap(s, cap):
    """cap * tanh(s / cap), tanh as 2 sigmoid(2x) - 1 (the interpreter has no tanh). On
    log2-domain scores with cap * log2(e) it caps the natural-domain scores by cap."""
    return cap * (2.0 * tl.sigmoid(2.0 * (s / cap)) - 1.0)


@triton.jit
def load_kv_tile(cache_ptr, row_offsets, valid, d, d_valid, DOT_DTYPE: tl.constexpr):
    """[BLOCK_N, BLOCK_D] tile in the dot dtype; fp8 goes through fp32, which the interpreter
    converts exactly (its fp8 -> fp16 path drops e5m2 subnormals)."""
    x = tl.load(cache_ptr + row_offsets[:, None] + d[None, :],
                mask=valid[:, None] & d_valid[None, :], other=0.0)
    return x.to(tl.float32).to(DOT_DTYPE)


def decode_block_n(block_d: int) -> int:
    """Keys per decode tile: K and V tiles stay within registers at head_dim 256."""
    return 64 if block_d <= 128 else 32


def prefill_rows(group: int, block_d: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_Q query tokens) of a prefill tile: rows = tokens x group."""
    block_m = max(64 if block_d <= 128 else 32, triton.next_power_of_2(group))
    return block_m, block_m // group


def prefill_block_n(block_d: int, dot_dtype) -> int:
    """Keys per prefill tile, so Q, K and V tiles fit a GPU's shared memory even with fp32
    operands at head_dim 256. Not tuned on hardware (see benchmarks/README.md)."""
    if block_d <= 64:
        return 64
    if block_d <= 128 or dot_dtype != tl.float32:
        return 32
    return 16
