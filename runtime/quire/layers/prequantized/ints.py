"""A checkpoint's integer weights as Quire's canonical int4 / int8 tensors (quant_formats.py),
with the file's values: w = (q - z) * s, each weight one fp32 rounding of an exact product,
as the formats' own libraries compute it in fp32.

int4 keeps w = (q - 8) * s + zero with zero = (8 - z) * s. That is the same single rounding
whenever (q - 8) * s and zero are exact in fp32 and so is their sum: always for float16 and
bfloat16 scales (GPTQ's and AWQ's are float16; compressed-tensors' follow the model, bf16 in
practice). Where fp32 scales make it round (checked per layer, every q of every group), the
layer keeps q - z as int8 instead: twice the bytes, the same values, logged.
8-bit weights are symmetric (z = 128, q - 128 as int8); other zero points are refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from quire.layers import quant_formats as qf
from quire.layers.prequantized import act_order

logger = logging.getLogger(__name__)


@dataclass
class Canonical:
    kind: str                          # int4 | int8 | fp8
    tensors: dict[str, torch.Tensor]   # the canonical tensors, in quant_formats' order
    in_features: int                   # the checkpoint's K (before act-order padding)
    perm: torch.Tensor | None = None   # act-order: the input column of each kernel column
    padded: bool = False
    extra: dict = field(default_factory=dict)


def canonical_int(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  g_idx: torch.Tensor | None, bits: int, name: str) -> Canonical:
    """q: unsigned values [N, K]; scales [N, S] (any float dtype); zeros: unsigned zero points
    [N, S] (None: symmetric, 2^(bits-1)); g_idx: [K] column -> scale column (None: k // G)."""
    n, k = q.shape
    if g_idx is None:
        g_idx = torch.arange(k) // (k // scales.shape[1])
    s = scales.float()
    z = (torch.full(s.shape, 1 << (bits - 1), dtype=torch.int16) if zeros is None
         else zeros.to(torch.int16))
    plan = act_order.plan(g_idx, int4=bits == 4)
    if plan.perm is not None:
        q = torch.nn.functional.pad(q, (0, 1)).index_select(1, plan.perm)
    s, z = s[:, plan.block_groups], z[:, plan.block_groups]
    out = Canonical(qf.INT8, {}, k, plan.perm, plan.padded)
    if bits == 8:
        if not bool((z == 128).all()):
            raise ValueError(f"{name}: 8-bit weights with zero points other than 128 "
                             "(asymmetric int8) are not supported; supported: symmetric int8, "
                             "int4 symmetric or asymmetric")
        out.tensors = {"qweight": (q.to(torch.int16) - 128).to(torch.int8), "scales": s}
        return out
    zero = (8 - z).float() * s
    if _int4_exact(s, z, zero):
        out.kind = qf.INT4
        out.tensors = {"qweight": qf.pack_nibbles(q), "scales": s, "zeros": zero}
        return out
    logger.info("%s: its zero points are not exact in int4's (q - 8) * s + zero with fp32 "
                "scales; kept as int8 q - z (the same values, twice the bytes)", name)
    per_column = z.repeat_interleave(plan.group, dim=1)
    out.tensors = {"qweight": (q.to(torch.int16) - per_column).to(torch.int8), "scales": s}
    return out


def _int4_exact(s: torch.Tensor, z: torch.Tensor, zero: torch.Tensor) -> bool:
    """(v - 8) * s + zero == (v - z) * s in fp32 for every v in 0..15 and every group."""
    v = torch.arange(16, dtype=torch.float32)
    canonical = (v - 8.0) * s[..., None] + zero[..., None]
    file = (v - z[..., None].float()) * s[..., None]
    return bool(torch.equal(canonical, file))
