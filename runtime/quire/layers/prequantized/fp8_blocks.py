"""Hugging Face's fine-grained FP8 checkpoints (quant_method "fp8", e.g. DeepSeek-V3 and the
Qwen3-*-FP8 releases):

    weight            float8_e4m3fn [N, K]
    weight_scale_inv  fp32 [ceil(N / bn), ceil(K / bk)]   weight_block_size [bn, bk]
    w = weight * weight_scale_inv[n // bn, k // bk]   (the name notwithstanding, a multiply)

Activations are quantized dynamically per token group on GPUs that run FP8; here the weights
are read into fp8.py's canonical form (block scales repeated over their rows).
"""

from __future__ import annotations

import torch

from quire.layers.prequantized import fp8
from quire.layers.prequantized.base import (
    LayerFormat,
    PrequantizedConfig,
    RawParam,
    UnsupportedScheme,
)
from quire.layers.prequantized.ints import Canonical


def block_rows(bn: int):
    """Block scales [N / bn, ...] -> one row per weight row (what a rank's shard reads)."""
    return lambda s: s.float().repeat_interleave(bn, dim=0)


def fp8_raw_params(layer, k: int, n: int, scale_name: str, block: tuple[int, int] | None,
                   per_tensor: bool, input_scale: bool) -> list[RawParam]:
    """The weight and its scales, shared with compressed-tensors' float-quantized format."""
    params = [RawParam("weight", (n, k), fp8.FP8_DTYPE, output_dim=0, input_dim=1)]
    if block is not None:
        bn, bk = block
        if k % bk:
            raise UnsupportedScheme(f"{layer.prefix}: FP8 block size {bk} does not divide this "
                                    f"rank's input size {k}; supported: blocks that do")
        params.append(RawParam(scale_name, (n, k // bk), torch.float32, output_dim=0,
                               input_dim=1, prepare=block_rows(bn)))
    elif per_tensor:
        params.append(RawParam(scale_name, (), torch.float32, per_part=True))
    else:  # per output channel
        params.append(RawParam(scale_name, (n, 1), torch.float32, output_dim=0))
    if input_scale:
        params.append(RawParam("input_scale", (), torch.float32, per_part=True))
    return params


def fp8_canonical(layer, weight: torch.Tensor, scales: torch.Tensor,
                  input_scale: torch.Tensor | None, sizes: list[int]) -> Canonical:
    if scales.dim() == 1:  # per tensor, one per fused part: repeated over the part's rows
        scales = torch.repeat_interleave(scales, torch.tensor(sizes))[:, None]
    extra = {} if input_scale is None else {"input_scale": input_scale.max()}
    return Canonical(fp8.FP8, {"weight": weight, "scales": scales.float().contiguous()},
                     weight.shape[1], extra=extra)


class Fp8BlockFormat(LayerFormat):
    kind = fp8.FP8

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def raw_params(self, layer, k, n):
        return fp8_raw_params(layer, k, n, "weight_scale_inv", self.block, False, False)

    def canonical(self, layer, raw):
        return fp8_canonical(layer, raw["weight"], raw["weight_scale_inv"], None,
                             [layer.out_features])


class Fp8BlockConfig(PrequantizedConfig):
    name = "fp8"

    def __init__(self, qcfg, tensor_names):
        super().__init__(qcfg, tensor_names)
        block = qcfg.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise UnsupportedScheme(f"fp8: weight_block_size {block!r} is not supported; "
                                    "supported: two positive block sizes, e.g. [128, 128]")
        scheme = qcfg.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise UnsupportedScheme(f"fp8: activation_scheme {scheme!r} is not supported; "
                                    "supported: dynamic")
        if qcfg.get("scale_fmt") not in (None, "float", "float32", "fp32"):
            raise UnsupportedScheme(f"fp8: scale_fmt {qcfg.get('scale_fmt')!r} is not "
                                    "supported; supported: float32 scales")
        self.block = tuple(block)

    def scheme_for(self, module):
        return "fp8" if self.has(module, "weight_scale_inv") else None

    def layer_format(self, scheme, prefix):
        return Fp8BlockFormat(self.block)
