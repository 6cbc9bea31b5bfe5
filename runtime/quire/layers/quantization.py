"""Quant methods: how a linear layer stores its weight and multiplies by it.

A `LinearMethod` owns a layer's weight *format*: it creates the parameters (`create_weights`),
turns what was loaded into what the kernel wants (`process_weights_after_loading`), and
computes x @ W^T + b (`apply`). The layer around it owns the tensor-parallel shard and the
loading; the model file owns neither. A `QuantConfig` picks a method per layer (by its
prefix, e.g. "layers.3.mlp.down_proj"), so one checkpoint may mix formats.

Methods (the formats are in quant_formats.py; the kernels in quant_kernels.py):
- FloatLinearMethod: a float [out, in] weight.
- Int8LinearMethod / Int4LinearMethod: weight-only `qweight` + `scales` (+ `zeros` for int4),
  each parameter tagged with `output_dim` / `input_dim`, so the layer's generic weight_loader
  shards them like a float weight (the packed int4 input dim and the scale groups shard by
  the same rank fraction). With `from_float=True` they create a float `weight` instead and
  quantize it in process_weights_after_loading (a float checkpoint, `--quantization int8`).
- Every method sees the *local* shard shape (`in_features` / `out_features` are per rank), so
  no method knows about tensor parallelism; a group size must divide the local input size.

Configs: QuantConfig (float everywhere), QuantizeOnLoadConfig (int8/int4 from a float
checkpoint, decoder-layer linears only), CheckpointQuantConfig (a per-layer manifest written
with the canonical tensors, e.g. by the GGUF repack: models/gguf_repack.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quire.layers import quant_formats as qf
from quire.layers import quant_kernels
from quire.native import packed_linear


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
    with F.linear, whose exact sums the transformers parity tests rely on. bf16 on CPU: a
    layer without bias takes the native kernel's own copy (quant_kernels.DenseBf16Kernel:
    decode rows at one weight read, prefill through oneDNN where it has bf16 kernels), one
    with a bias the oneDNN-packed copy (native/packed_linear.py, bit-identical to F.linear);
    either way the plain copy is freed unless something else still reads it."""

    def create_weights(self, layer, in_features, out_features, dtype):
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                              requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)
        layer.packed_weight = layer.native_kernel = None

    def process_weights_after_loading(self, layer):
        layer.native_kernel = layer.packed_weight = None
        if getattr(layer, "bias", None) is None:
            layer.native_kernel = quant_kernels.dense_bf16_kernel(layer.weight.data)
        if layer.native_kernel is None:
            layer.packed_weight = packed_linear.pack(layer.weight)
        held = layer.native_kernel is not None or layer.packed_weight is not None
        if held and not getattr(layer, "keep_plain_weight", False):
            layer.weight.data = layer.weight.data.new_empty(0)

    def apply(self, layer, x, bias):
        if layer.native_kernel is not None:
            return layer.native_kernel(x)  # (bias-free layers only)
        if layer.packed_weight is not None:
            return packed_linear.linear(x, layer.packed_weight, bias)
        return F.linear(x, layer.weight, bias)


def _param(layer, name, shape, dtype, output_dim=0, input_dim=1):
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.output_dim, p.input_dim = output_dim, input_dim
    layer.register_parameter(name, p)
    return p


class _WeightOnlyMethod(LinearMethod):
    """Shared by int8 and int4: canonical tensors in, one kernel (quant_kernels) out.
    `exact`: the values are a checkpoint's own (GGUF), so only kernels that keep them exactly
    may run them (not torch's ops, whose scales are rounded to the activation dtype)."""

    kind = "?"
    tensor_names: tuple[str, ...] = ()

    def __init__(self, group_size: int | None, from_float: bool = False,
                 exact: bool = True) -> None:
        self.group_size, self.from_float, self.exact = group_size, from_float, exact

    def group_for(self, in_features: int) -> int:
        return self.group_size or in_features

    def create_weights(self, layer, in_features, out_features, dtype):
        group = self.group_for(in_features)
        qf.check_group(f"{getattr(layer, 'prefix', '')} ({self.kind})", in_features, group)
        layer.quant_group = group
        if self.from_float:
            _param(layer, "weight", (out_features, in_features), dtype)
        else:
            self.create_quantized(layer, in_features, out_features, group)
        layer.quant_kernel = None

    def create_quantized(self, layer, in_features, out_features, group):
        raise NotImplementedError

    def quantize(self, w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def make_kernel(self, *tensors) -> quant_kernels.Kernel:
        raise NotImplementedError

    def process_weights_after_loading(self, layer):
        if self.from_float:
            tensors = self.quantize(layer.weight.data, layer.quant_group)
            del layer.weight
            for name, t in zip(self.tensor_names, tensors):
                _param(layer, name, tuple(t.shape), t.dtype).data = t
        layer.quant_kernel = self.make_kernel(*(getattr(layer, n).data
                                                for n in self.tensor_names))
        if layer.quant_kernel.owns_weights and not getattr(layer, "keep_canonical", False):
            for name in self.tensor_names:  # the kernel keeps its own packed copy
                getattr(layer, name).data = getattr(layer, name).data.new_empty(0)

    def dequantized(self, layer) -> torch.Tensor:
        """The fp32 weight this layer multiplies by (tests, and the transformers oracle)."""
        if getattr(layer, "quant_kernel", None) is not None:
            return layer.quant_kernel.dequantize()
        return self.dequantize_canonical(layer)

    def dequantize_canonical(self, layer) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, layer, x, bias):
        shape = x.shape
        y = layer.quant_kernel(x.reshape(-1, shape[-1]))
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y if bias is None else y + bias


class Int8LinearMethod(_WeightOnlyMethod):
    """qweight int8 [N, K], scales fp32 [N, K//G]; G = K (per output channel) by default."""

    kind = qf.INT8
    tensor_names = ("qweight", "scales")

    def create_quantized(self, layer, in_features, out_features, group):
        _param(layer, "qweight", (out_features, in_features), torch.int8)
        _param(layer, "scales", (out_features, in_features // group), torch.float32)

    def quantize(self, w, group):
        return qf.quantize_int8(w, group)

    def make_kernel(self, qweight, scales):
        return quant_kernels.int8_kernel(qweight, scales, exact=self.exact)

    def dequantize_canonical(self, layer):
        return qf.dequantize_int8(layer.qweight, layer.scales)


class Int4LinearMethod(_WeightOnlyMethod):
    """qweight uint8 [N, K//2] (low nibble = even k), scales and zeros fp32 [N, K//G]."""

    kind = qf.INT4
    tensor_names = ("qweight", "scales", "zeros")

    def create_quantized(self, layer, in_features, out_features, group):
        if in_features % 2:
            raise ValueError(f"{getattr(layer, 'prefix', '')}: int4 needs an even input size, "
                             f"got {in_features}")
        _param(layer, "qweight", (out_features, in_features // 2), torch.uint8)
        _param(layer, "scales", (out_features, in_features // group), torch.float32)
        _param(layer, "zeros", (out_features, in_features // group), torch.float32)

    def quantize(self, w, group):
        return qf.quantize_int4(w, group)

    def make_kernel(self, qweight, scales, zeros):
        return quant_kernels.int4_kernel(qweight, scales, zeros, exact=self.exact)

    def dequantize_canonical(self, layer):
        return qf.dequantize_int4(layer.qweight, layer.scales, layer.zeros)


METHODS = {qf.INT8: Int8LinearMethod, qf.INT4: Int4LinearMethod}


class QuantConfig:
    """Chooses each linear layer's method; this one (no quantization) is float everywhere.
    `embedding_method` is the embedding table's format (None: float)."""

    name = "none"

    def method_for(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return FloatLinearMethod()

    def embedding_method(self, prefix: str) -> LinearMethod | None:
        return None


NO_QUANT = QuantConfig()


class QuantizeOnLoadConfig(QuantConfig):
    """`--quantization int8|int4` on a float checkpoint: every linear of the decoder layers
    is quantized as it loads (int8 symmetric per output channel, int4 asymmetric per group);
    the embedding and the LM head stay float."""

    def __init__(self, kind: str, group_size: int | None = None) -> None:
        if kind not in METHODS:
            raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {kind!r}")
        self.name = kind
        self.group_size = group_size if kind == qf.INT4 else None

    def method_for(self, layer, prefix):
        if not prefix.startswith("layers."):
            return FloatLinearMethod()
        return METHODS[self.name](self.group_size, from_float=True, exact=False)


class CheckpointQuantConfig(QuantConfig):
    """Formats read from the checkpoint's own manifest: {our layer prefix: {"method": "int8"
    | "int4" | "none", "group_size": G}} (`embed_tokens` for the embedding table; a tied
    `lm_head` follows it). These are the file's own values, so kernels must keep them
    exactly."""

    name = "checkpoint"

    def __init__(self, layers: dict[str, dict]) -> None:
        self.layers = layers

    def _method(self, prefix: str) -> LinearMethod | None:
        entry = self.layers.get(prefix)
        if entry is None or entry["method"] == "none":
            return None
        return METHODS[entry["method"]](entry["group_size"], from_float=False, exact=True)

    def method_for(self, layer, prefix):
        return self._method(prefix) or FloatLinearMethod()

    def embedding_method(self, prefix):
        return self._method(prefix)


def describe(model: nn.Module) -> str:
    """'int4 native-int4 x210, int8 native-int8 x1' for the start-up log ('float' if none)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        kernel = getattr(module, "quant_kernel", None)
        if kernel is not None:
            key = f"{module.quant_method.kind} {kernel.name}"
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())) or "float"
