"""AWQ checkpoints (AutoAWQ's GEMM layout, auto-round's AWQ export), 4 bits with zero points:

    qweight int32 [K, N / 8]   8 values a word along N, in AWQ's interleaved order
                               (packing.AWQ_NIBBLE_OF_COLUMN)
    qzeros  int32 [K / G, N / 8]  the same packing
    scales  fp16  [K / G, N]
    w[n, k] = (q[k, n] - z[k // G, n]) * scales[k // G, n]
"""

from __future__ import annotations

import torch

from quire.layers import quant_formats as qf
from quire.layers.prequantized import packing
from quire.layers.prequantized.base import (
    LayerFormat,
    PrequantizedConfig,
    RawParam,
    UnsupportedScheme,
)
from quire.layers.prequantized.ints import canonical_int


class AwqFormat(LayerFormat):
    kind = qf.INT4

    def __init__(self, group: int) -> None:
        self.group = group

    def raw_params(self, layer, k, n):
        if k % self.group:
            raise UnsupportedScheme(f"{layer.prefix}: AWQ group size {self.group} does not "
                                    f"divide this rank's input size {k}; use a tensor-parallel "
                                    "size that leaves whole groups")
        if n % 8:
            raise UnsupportedScheme(f"{layer.prefix}: AWQ packs 8 output columns a word; this "
                                    f"rank's output size {n} does not divide")
        s = k // self.group
        return [RawParam("qweight", (k, n // 8), torch.int32, output_dim=1, input_dim=0,
                         packed_dim=1, pack_factor=8),
                RawParam("qzeros", (s, n // 8), torch.int32, output_dim=1, input_dim=0,
                         packed_dim=1, pack_factor=8),
                RawParam("scales", (s, n), torch.float32, output_dim=1, input_dim=0)]

    def canonical(self, layer, raw):
        q = packing.unpack_awq(raw["qweight"]).T.contiguous()
        zeros = packing.unpack_awq(raw["qzeros"]).T
        return canonical_int(q, raw["scales"].T, zeros, None, 4, layer.prefix)


class AwqConfig(PrequantizedConfig):
    name = "awq"

    def __init__(self, qcfg, tensor_names):
        super().__init__(qcfg, tensor_names)
        bits = qcfg.get("bits", qcfg.get("w_bit"))
        group = qcfg.get("group_size", qcfg.get("q_group_size"))
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedScheme(f"awq: version {version!r} is not supported; supported: "
                                    "gemm (AutoAWQ's default packing)")
        if bits != 4:
            raise UnsupportedScheme(f"awq: {bits}-bit weights are not supported; supported: "
                                    "4 bits")
        if not qcfg.get("zero_point", True):
            raise UnsupportedScheme("awq: zero_point false is not supported; supported: AWQ "
                                    "with zero points")
        if not isinstance(group, int) or group <= 0 or group % 32:
            raise UnsupportedScheme(f"awq: group_size {group} is not supported; supported: a "
                                    "multiple of 32 (32, 64, 128, ...)")
        self.group = group

    def scheme_for(self, module):
        return "awq" if self.has(module, "qweight") else None

    def layer_format(self, scheme, prefix):
        return AwqFormat(self.group)
