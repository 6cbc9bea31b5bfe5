"""The canonical weight-only quantized formats: what loaders produce and kernels consume.

    int8  qweight int8  [N, K]     scales fp32 [N, K//G]
          w[n, k] = q * scale[n, k//G]
    int4  qweight uint8 [N, K//2]  (two 4-bit values per byte, low nibble = even k)
          scales fp32 [N, K//G], zeros fp32 [N, K//G]
          w[n, k] = (q - 8) * scale[n, k//G] + zero[n, k//G]

G = K is per output channel. Dequantizing is one fp32 multiply (int8) or a multiply and an
add (int4), so a GGUF block whose own formula is the same arithmetic maps onto these with the
very same values (models/gguf_repack.py). Quantizing a float weight: int8 symmetric
(scale = absmax / 127), int4 asymmetric from the group's min and max.
"""

from __future__ import annotations

import torch

INT8, INT4 = "int8", "int4"
INT4_GROUP_SIZES = (32, 64, 128)


def check_group(name: str, k: int, group: int) -> None:
    if group <= 0 or k % group:
        fits = [g for g in INT4_GROUP_SIZES if k % g == 0]
        hint = (f"--quantization-group-size {' or '.join(map(str, fits))} divides it" if fits
                else f"none of the group sizes {', '.join(map(str, INT4_GROUP_SIZES))} divides "
                     "it: use --quantization int8 (per output channel) or none")
        raise ValueError(f"{name}: group size {group} must divide the input size {k} "
                         f"(this rank's shard of it under tensor parallelism); {hint}")


def quantize_int8(w: torch.Tensor, group: int | None = None):
    """(qweight int8 [N, K], scales fp32 [N, K//G]); group None = per output channel."""
    n, k = w.shape
    group = group or k
    check_group("int8", k, group)
    g = w.float().reshape(n, k // group, group)
    scales = g.abs().amax(-1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(g / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), scales


def quantize_int4(w: torch.Tensor, group: int):
    """(qweight uint8 [N, K//2], scales, zeros fp32 [N, K//G]): q = round((w - min) / scale)
    with scale = (max - min) / 15, so q = 0 is the group's min and q = 15 its max."""
    n, k = w.shape
    check_group("int4", k, group)
    if k % 2:
        raise ValueError(f"int4 needs an even input size, got {k}")
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = (hi - lo) / 15.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    zeros = lo + 8.0 * scales  # (q - 8) * scale + zero == q * scale + lo
    return pack_nibbles(q.reshape(n, k)), scales, zeros


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K//2] uint8, even k in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K//2] uint8 -> [N, K] uint8 values 0..15."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = qweight.shape
    group = k // scales.shape[1]
    w = qweight.float().reshape(n, -1, group) * scales.float()[..., None]
    return w.reshape(n, k)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor) -> torch.Tensor:
    q = unpack_nibbles(qweight)
    n, k = q.shape
    group = k // scales.shape[1]
    w = (q.float().reshape(n, -1, group) - 8.0) * scales.float()[..., None]
    return (w + zeros.float()[..., None]).reshape(n, k)
