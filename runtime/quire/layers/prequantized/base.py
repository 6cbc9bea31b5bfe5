"""What every pre-quantized checkpoint format shares: its tensors loaded as they are in the
file (`RawParam`: the checkpoint's own names, dtypes and packing, each rank reading its
shard), then repacked once per layer into a canonical form (ints.py, fp8.py) that the
kernels take (`PrequantizedLinearMethod`), and the per-layer choice of format
(`PrequantizedConfig`).

A format module says which tensors a quantized layer has (`LayerFormat.raw_params`) and how
they become canonical (`LayerFormat.canonical`); nothing else of it is format-specific.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from quire.layers import quant_formats as qf
from quire.layers import quant_kernels
from quire.layers.prequantized import act_order
from quire.layers.prequantized import fp8 as fp8_format
from quire.layers.prequantized.ints import Canonical
from quire.layers.quant_kernel_base import Kernel
from quire.layers.quantization import FloatLinearMethod, LinearMethod, QuantConfig
from quire.layers.weights import materialize, narrow, shape_of

logger = logging.getLogger(__name__)


class UnsupportedScheme(ValueError):
    """A checkpoint's quantization that Quire does not run: one line, naming the scheme and
    what is supported."""


@dataclass
class RawParam:
    """One checkpoint tensor of a quantized layer, as stored. Dims are of the stored tensor;
    `packed_dim` holds `pack_factor` values per element. `per_part`: one per fused part
    (a leading part dim is added). `prepare` turns the whole (small) stored tensor into the
    form that is sharded (block scales expanded to rows)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    output_dim: int | None = None
    input_dim: int | None = None
    packed_dim: int | None = None
    pack_factor: int = 1
    per_part: bool = False
    prepare: Callable[[torch.Tensor], torch.Tensor] | None = None


def parts(layer) -> list:
    """The shard ids of a layer's fused parts ([None] for a plain layer)."""
    sizes = getattr(layer, "output_sizes", None)
    if sizes is None:
        return [None]
    return list(getattr(layer, "_PARTS", range(len(sizes))))


def part_sizes(layer) -> list[int]:
    return list(getattr(layer, "output_sizes", None) or [layer.out_features])


def _load_raw(layer, param: nn.Parameter, loaded, shard_id) -> None:
    spec: RawParam = param.raw
    target = param.data
    if spec.name == "weight_scale":  # the dtype the checkpoint's library dequantizes in
        layer.checkpoint_scale_dtype = loaded.dtype
    if spec.per_part:
        target = target[parts(layer).index(shard_id)]
    if spec.prepare is not None:
        loaded = spec.prepare(materialize(loaded))
    logical = list(target.shape)
    if spec.packed_dim is not None:
        logical[spec.packed_dim] *= spec.pack_factor
    proxy = SimpleNamespace(output_dim=spec.output_dim, input_dim=spec.input_dim,
                            shape=logical)
    for dim, (start, length, dst) in layer.shard_ranges(proxy, shard_id).items():
        if dim == spec.packed_dim:
            f = spec.pack_factor
            if start % f or length % f or dst % f:
                raise UnsupportedScheme(
                    f"{layer.prefix}.{spec.name}: this rank's shard (rows {start}..."
                    f"{start + length}) splits a packed word of {f} values; use a tensor-"
                    "parallel size that divides the layer into whole words")
            start, length, dst = start // f, length // f, dst // f
        loaded = narrow(loaded, dim, start, length)
        target = target.narrow(dim, dst, length)
    loaded = materialize(loaded)
    if spec.prepare is not None:  # expanded block rows may run past the checkpoint's rows
        for dim, size in enumerate(target.shape):
            if loaded.shape[dim] > size:
                loaded = loaded.narrow(dim, 0, size)
    if spec.per_part and loaded.numel() == 1:
        loaded = loaded.reshape(target.shape)
    if tuple(loaded.shape) != tuple(target.shape):
        raise ValueError(f"{layer.prefix}.{spec.name} ({shard_id if shard_id is not None else 'whole'}) "
                         f"has shape {shape_of(loaded)} for this rank's shard; the config "
                         f"implies {tuple(target.shape)}")
    target.copy_(loaded)


class LayerFormat:
    """A format's tensors for one layer and their repacking."""

    kind = "?"  # what the layer will most likely hold (int4 / int8 / fp8): for messages

    def raw_params(self, layer, in_features: int, out_features: int) -> list[RawParam]:
        raise NotImplementedError

    def canonical(self, layer, raw: dict[str, torch.Tensor]) -> Canonical:
        raise NotImplementedError


class PrequantizedLinearMethod(LinearMethod):
    """Loads a checkpoint format's own tensors, repacks them once into canonical int4 / int8
    / fp8 tensors, multiplies with quant_kernels' (or fp8's) kernel. `exact`: the values are
    the file's, so only exact kernels run them."""

    def __init__(self, fmt: LayerFormat) -> None:
        self.fmt = fmt
        self.kind = fmt.kind
        self.tensor_names: tuple[str, ...] = ()
        self.raw_names: list[str] = []

    def create_weights(self, layer, in_features, out_features, dtype):
        self.dtype = dtype
        layer.quant_kernel = None
        layer.checkpoint_scale_dtype = None
        layer.input_perm, layer.input_padded = None, False
        for spec in self.fmt.raw_params(layer, in_features, out_features):
            shape = ((len(parts(layer)),) if spec.per_part else ()) + tuple(spec.shape)
            p = nn.Parameter(torch.zeros(shape, dtype=spec.dtype), requires_grad=False)
            p.output_dim, p.input_dim = spec.output_dim, spec.input_dim
            p.raw, p.weight_loader = spec, _load_raw
            layer.register_parameter(spec.name, p)
            self.raw_names.append(spec.name)

    def process_weights_after_loading(self, layer):
        raw = {n: getattr(layer, n).data for n in self.raw_names}
        for n in self.raw_names:
            delattr(layer, n)
        device = next(iter(raw.values())).device
        c = self.fmt.canonical(layer, {n: t.cpu() for n, t in raw.items()})
        del raw
        self.kind, self.tensor_names = c.kind, tuple(c.tensors)
        for name, t in c.tensors.items():
            p = nn.Parameter(t.to(device), requires_grad=False)
            p.output_dim, p.input_dim = 0, 1
            layer.register_parameter(name, p)
        layer.quant_group = None
        if c.perm is not None:
            layer.input_perm, layer.input_padded = c.perm.to(device), c.padded
        layer.checkpoint_in_features = c.in_features
        tensors = [getattr(layer, n).data for n in self.tensor_names]
        if c.kind == qf.INT4:
            layer.quant_kernel = quant_kernels.int4_kernel(*tensors, exact=True)
        elif c.kind == qf.INT8:
            layer.quant_kernel = quant_kernels.int8_kernel(*tensors, exact=True)
        else:
            input_scale = c.extra.get("input_scale")
            layer.quant_kernel = fp8_format.kernel(
                *tensors, None if input_scale is None else input_scale.to(device))
        self._round_like_the_library(layer)
        if layer.quant_kernel.owns_weights:  # the kernel keeps its own packed copy
            for name in self.tensor_names:
                getattr(layer, name).data = getattr(layer, name).data.new_empty(0)

    def _round_like_the_library(self, layer) -> None:
        """compressed-tensors dequantizes (q - z) * scale in the scale's dtype: from a bf16
        checkpoint every weight is rounded to bf16 (transformers' float32 model holds those
        values, and vLLM's kernels dequantize in bf16 too). Exact fp32 products would differ
        from them by a bf16 rounding per weight (~4e-3 in logprobs). At float32, where the
        promise is the library's values exactly, a layer whose weights that rounding changes
        multiplies by the rounded weights, dequantized once (float32 memory, logged)."""
        scale_dtype = layer.checkpoint_scale_dtype
        if (not getattr(self.fmt, "dequantizes_in_scale_dtype", False)
                or self.dtype != torch.float32
                or scale_dtype not in (torch.bfloat16, torch.float16)):
            return
        w = layer.quant_kernel.dequantize().float()
        rounded = w.to(scale_dtype).float()
        if torch.equal(w, rounded):
            return
        logger.info("%s: its library dequantizes in %s (each weight rounded); at float32 it "
                    "runs on those weights, dequantized once", layer.prefix, scale_dtype)
        layer.quant_kernel = DequantizedKernel(rounded.to(w.device))

    def dequantized(self, layer) -> torch.Tensor:
        """The fp32 weight [N, K] this layer multiplies by, in the checkpoint's column order
        (tests: the oracle's weights)."""
        w = layer.quant_kernel.dequantize().float().cpu()
        if layer.input_perm is not None:
            w = act_order.ungather_weight(w, layer.input_perm.cpu(), layer.checkpoint_in_features)
        return w

    def apply(self, layer, x, bias):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.input_perm is not None:
            x2 = act_order.gather_input(x2, layer.input_perm, layer.input_padded)
        y = layer.quant_kernel(x2)
        y = y.reshape(*shape[:-1], y.shape[-1])
        return y if bias is None else y + bias



class DequantizedKernel(Kernel):
    """A float32 matmul over weights dequantized once (the library's own values)."""
    name = "dequantized-fp32"
    owns_weights = True

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def dequantize(self) -> torch.Tensor:
        return self.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype))


# --- which layers are quantized ------------------------------------------------------------
# our layer -> the transformers modules fused into it (the Llama-style families' names)
_FUSED_MODULES = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                  "o_proj": ("self_attn.o_proj",), "down_proj": ("mlp.down_proj",)}


def checkpoint_modules(prefix: str) -> list[str]:
    """'layers.3.qkv_proj' -> the checkpoint's q/k/v module names; 'lm_head' -> 'lm_head'."""
    if prefix.startswith("layers."):
        _, idx, rest = prefix.split(".", 2)
        if rest in _FUSED_MODULES:
            return [f"model.layers.{idx}.{m}" for m in _FUSED_MODULES[rest]]
    return [prefix if prefix == "lm_head" else f"model.{prefix}"]


def matches(name: str, pattern: str) -> bool:
    """compressed-tensors' target syntax: an exact module name or 're:<regex>' (re.match)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern


class PrequantizedConfig(QuantConfig):
    """A pre-quantized checkpoint: `scheme_for(module)` says how one checkpoint module is
    stored (None: float), `layer_format(scheme, prefix)` builds its LayerFormat. The parts of
    one fused layer must share a scheme; a quantized LM head or embedding is refused."""

    name = "?"

    def __init__(self, qcfg: dict, tensor_names: set[str]) -> None:
        self.qcfg, self.tensor_names = qcfg, tensor_names

    def scheme_for(self, module: str):
        raise NotImplementedError

    def layer_format(self, scheme, prefix: str) -> LayerFormat:
        raise NotImplementedError

    def has(self, module: str, tensor: str) -> bool:
        return f"{module}.{tensor}" in self.tensor_names

    def method_for(self, layer, prefix):
        modules = checkpoint_modules(prefix)
        schemes = [self.scheme_for(m) for m in modules]
        if all(s is None for s in schemes):
            return FloatLinearMethod()
        if prefix == "lm_head":
            raise UnsupportedScheme(f"{self.name}: a quantized lm_head is not supported; "
                                    "supported: quantized decoder-layer linears (lm_head float)")
        if any(s != schemes[0] for s in schemes):
            raise UnsupportedScheme(f"{self.name}: the modules fused into {prefix} "
                                    f"({', '.join(modules)}) are quantized differently; "
                                    "supported: one scheme for all of them")
        return PrequantizedLinearMethod(self.layer_format(schemes[0], prefix))

    def embedding_method(self, prefix):
        if self.scheme_for(f"model.{prefix}") is not None:
            raise UnsupportedScheme(f"{self.name}: a quantized embedding ({prefix}) is not "
                                    "supported; supported: quantized decoder-layer linears")
        return None
