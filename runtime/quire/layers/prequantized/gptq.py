"""GPTQ checkpoints (AutoGPTQ / GPTQModel / auto-round's GPTQ export), 4 and 8 bits:

    qweight int32 [K / f, N]   f = 32 / bits values per word along K (lowest bits first)
    qzeros  int32 [S, N / f]   zero points packed along N; the v1 format ("gptq") stores
                               z - 1, so z = stored + 1; "gptq_v2" stores z
    scales  fp16  [S, N]
    g_idx   int32 [K]          column -> group; k // G unless act-order (desc_act)
    w[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]

With act-order a rank of a row-parallel layer keeps its columns' g_idx and every group's
scales and zeros (its columns may belong to any group); act_order.py sorts its columns into
groups.
"""

from __future__ import annotations

import torch

from quire.layers import quant_formats as qf
from quire.layers.linear import RowParallelLinear
from quire.layers.prequantized import packing
from quire.layers.prequantized.base import (
    LayerFormat,
    PrequantizedConfig,
    RawParam,
    UnsupportedScheme,
)
from quire.layers.prequantized.ints import canonical_int

BITS = (4, 8)


class GptqFormat(LayerFormat):
    def __init__(self, bits: int, group: int | None, act_order: bool, v1: bool) -> None:
        self.bits, self.group, self.act_order, self.v1 = bits, group, act_order, v1
        self.kind = qf.INT4 if bits == 4 else qf.INT8
        self.f = 32 // bits

    def raw_params(self, layer, k, n):
        group = self.group or k * (layer.tp_size if isinstance(layer, RowParallelLinear)
                                   else 1)
        full_groups = isinstance(layer, RowParallelLinear) and (self.act_order or not self.group)
        if not full_groups and k % group:
            raise UnsupportedScheme(f"{layer.prefix}: GPTQ group size {group} does not divide "
                                    f"this rank's input size {k}; use a tensor-parallel size "
                                    "that leaves whole groups")
        k_total = k * layer.tp_size if full_groups else k
        s = -(-k_total // group)
        input_dim = None if full_groups else 0
        if k % self.f or n % self.f:
            raise UnsupportedScheme(f"{layer.prefix}: GPTQ {self.bits}-bit packs {self.f} values "
                                    f"a word; this rank's shape [{n}, {k}] does not divide")
        params = [
            RawParam("qweight", (k // self.f, n), torch.int32, output_dim=1, input_dim=0,
                     packed_dim=0, pack_factor=self.f),
            RawParam("qzeros", (s, n // self.f), torch.int32, output_dim=1, input_dim=input_dim,
                     packed_dim=1, pack_factor=self.f),
            RawParam("scales", (s, n), torch.float32, output_dim=1, input_dim=input_dim),
        ]
        if self.act_order:
            params.append(RawParam("g_idx", (k,), torch.int32, input_dim=0, per_part=True))
        return params

    def canonical(self, layer, raw):
        q = packing.unpack_int32(raw["qweight"], self.bits, dim=0).T.contiguous()
        zeros = packing.unpack_int32(raw["qzeros"], self.bits, dim=1).T.to(torch.int16)
        if self.v1:
            zeros = zeros + 1
        g_idx = None
        if self.act_order:
            per_part = raw["g_idx"].long()
            if not bool((per_part == per_part[0]).all()):
                raise UnsupportedScheme(f"{layer.prefix}: the GPTQ act-order g_idx of its "
                                        "fused parts differ; supported: one order for all")
            g_idx = per_part[0]
        return canonical_int(q, raw["scales"].T, zeros, g_idx, self.bits, layer.prefix)


class GptqConfig(PrequantizedConfig):
    name = "gptq"

    def __init__(self, qcfg, tensor_names):
        super().__init__(qcfg, tensor_names)
        bits = qcfg.get("bits")
        if bits not in BITS:
            raise UnsupportedScheme(f"gptq: {bits}-bit weights are not supported; supported: "
                                    f"bits {' or '.join(map(str, BITS))}")
        group = qcfg.get("group_size", -1)
        if group not in (-1, None) and (group <= 0 or group % 32):
            raise UnsupportedScheme(f"gptq: group_size {group} is not supported; supported: "
                                    "-1 (per channel) or a multiple of 32 (32, 64, 128, ...)")
        fmt = qcfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedScheme(f"gptq: checkpoint_format {fmt!r} is not supported; "
                                    "supported: gptq, gptq_v2")
        if qcfg.get("is_marlin_format") or qcfg.get("dynamic"):
            what = "is_marlin_format" if qcfg.get("is_marlin_format") else "dynamic"
            raise UnsupportedScheme(f"gptq: {what} is not supported; supported: one bits / "
                                    "group_size for every layer, gptq or gptq_v2 packing")
        if qcfg.get("lm_head"):
            raise UnsupportedScheme("gptq: a quantized lm_head (lm_head: true) is not "
                                    "supported; supported: quantized decoder-layer linears")
        self.bits = bits
        self.group = None if group in (-1, None) else group
        self.act_order = bool(qcfg.get("desc_act", False))
        self.v1 = fmt == "gptq"

    def scheme_for(self, module):
        return "gptq" if self.has(module, "qweight") else None

    def layer_format(self, scheme, prefix):
        return GptqFormat(self.bits, self.group, self.act_order, self.v1)
