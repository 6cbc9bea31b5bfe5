"""Integer unpacking shared by the checkpoint formats: several b-bit values in one int32 word,
value j of a word in bits [j*b, (j+1)*b) (GPTQ, compressed-tensors pack-quantized), or AWQ's
interleaved order within each word."""

from __future__ import annotations

import torch

# AWQ's GEMM packer writes output column order_map[j] into nibble j, order_map =
# [0, 2, 4, 6, 1, 3, 5, 7]; column c is therefore nibble AWQ_NIBBLE_OF_COLUMN[c]
AWQ_NIBBLE_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their unsigned b-bit values as uint8, `32 // bits` per word, the word's
    values consecutive along `dim` (lowest bits first)."""
    if 32 % bits:
        raise ValueError(f"cannot unpack {bits}-bit values from int32 words (4 or 8 bits)")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = words.to(torch.int32).movedim(dim, -1)
    values = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*w.shape[:-1], w.shape[-1] * per_word).to(torch.uint8)
    return values.movedim(-1, dim)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM int32 [R, C // 8] (columns packed, interleaved) -> uint8 [R, C]."""
    values = unpack_int32(words, 4, dim=1)  # in nibble order within each word
    r, c = values.shape
    order = torch.tensor(AWQ_NIBBLE_OF_COLUMN)
    index = (torch.arange(c // 8)[:, None] * 8 + order).reshape(-1)
    return values.reshape(r, c)[:, index]
