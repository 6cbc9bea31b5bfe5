"""Quant methods: how a linear layer stores its weight and multiplies by it.

A `LinearMethod` owns a layer's weight *format*: it creates the parameters (`create_weights`),
turns what was loaded into what the kernel wants (`process_weights_after_loading`), and
computes x @ W^T + b (`apply`). The layer around it owns the tensor-parallel shard and the
loading; the model file owns neither. A `QuantConfig` picks a method per layer (by its
prefix, e.g. "layers.3.mlp.down_proj"), so one checkpoint may mix formats.

Extension points:
- int8 / int4 weight-only: a QuantConfig whose `method_for` returns a method that creates
  `qweight` (packed along the input dim for int4) and per-channel or per-group `scales`, and
  tags each parameter with `output_dim` / `input_dim` (and `pack_factor`, `group_size` where
  the input dim is packed or grouped). The layer's generic weight_loader shards any
  parameter along the dims it is tagged with; a method whose format needs more (GGUF blocks,
  whose input dim is in 32-value blocks) sets `param.weight_loader` on that parameter, and
  the layer calls it instead. Quantizing a float checkpoint at load time needs no new
  parameters at all: create a float weight, quantize it in process_weights_after_loading.
- Every method sees the *local* shard shape (`in_features` / `out_features` are per rank), so
  no method knows about tensor parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quire.models import packed_linear


class LinearMethod:
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       dtype: torch.dtype | None) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every weight is loaded (repack, quantize, free what is not needed)."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class FloatLinearMethod(LinearMethod):
    """The weight as a float [out, in] matrix. fp32 (and everything off the CPU) multiplies
    with F.linear, whose exact sums the transformers parity tests rely on; bf16 on CPU uses
    the oneDNN-packed copy (models/packed_linear.py, bit-identical, packed once, the plain
    copy freed unless something else still reads it)."""

    def create_weights(self, layer, in_features, out_features, dtype):
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                              requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)
        layer.packed_weight = None

    def process_weights_after_loading(self, layer):
        layer.packed_weight = packed_linear.pack(layer.weight)
        if layer.packed_weight is not None and not getattr(layer, "keep_plain_weight", False):
            layer.weight.data = layer.weight.data.new_empty(0)

    def apply(self, layer, x, bias):
        if layer.packed_weight is not None:
            return packed_linear.linear(x, layer.packed_weight, bias)
        return F.linear(x, layer.weight, bias)


class QuantConfig:
    """Chooses each linear layer's method; this one (no quantization) is float everywhere."""

    name = "none"

    def method_for(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return FloatLinearMethod()


NO_QUANT = QuantConfig()
