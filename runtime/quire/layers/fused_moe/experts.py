"""How a MoE layer stores its experts' weights and multiplies by them: float, int8 or int4
weight-only, in the canonical formats of layers/quant_formats.py with a leading expert dim.

    w13  the gate and up projections, [E, 2 * I, H] as [gate | up] rows (I: this rank's)
    w2   the down projection, [E, H, I]

Float: `w13_weight`, `w2_weight` (+ `w13_bias` [E, 2I], `w2_bias` [E, H] where the family
has them). int8: `{w}_qweight` int8 [E, N, K], `{w}_scales` fp32 [E, N, K // G]. int4:
`{w}_qweight` uint8 [E, N, K // 2], `{w}_scales`, `{w}_zeros` fp32 [E, N, K // G].

A layer's format comes from the model's QuantConfig like any linear's (`experts_method`):
the LinearMethod it picks for the experts' prefix says float / int8 / int4, its group size,
whether the values are quantized here from a float checkpoint (`from_float`) and whether they
are a checkpoint's own (`exact`). Quantized weights keep their format: on the CPU each expert
gets the same native kernel a linear would (layers/quant_kernels.py), on CUDA the Triton
grouped kernel reads the canonical tensors directly (triton_moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quire.layers import quant_formats as qf
from quire.layers import quant_kernels
from quire.layers.quantization import (
    NO_QUANT,
    FloatLinearMethod,
    Int4LinearMethod,
    Int8LinearMethod,
    QuantConfig,
)
from quire.native import packed_linear

PROJECTIONS = ("w13", "w2")


def _param(layer: nn.Module, name: str, shape, dtype, proj: str, split: str | None,
           transposed: bool = False):
    """shape: [E, N, K] (or a bias's [E, N]). split: how tensor parallelism cuts each
    expert's [N, K] matrix: "rows" (w13: by the intermediate size), "cols" (w2), or None
    (replicated, w2's bias). transposed: stored as [E, K, N] (see logical)."""
    if transposed:
        shape = (shape[0], shape[2], shape[1])
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.moe_proj, p.moe_split, p.moe_transposed = proj, split, transposed
    layer.register_parameter(name, p)
    return p


def logical(p: nn.Parameter) -> torch.Tensor:
    """A weight as [E, N, K], whatever its storage: a float weight may be stored [E, K, N]
    (gpt-oss's checkpoints are): F.linear and grouped_mm on that transposed view compute
    transformers' `x @ W` on the same memory exactly, where a contiguous [E, N, K] copy
    rounds differently (a float32 product's sums depend on the memory layout)."""
    t = p.data
    return t.transpose(1, 2) if getattr(p, "moe_transposed", False) else t


class ExpertsMethod:
    kind = "float"
    tensor_names: tuple[str, ...] = ("weight",)

    def create_weights(self, layer, num_experts: int, hidden: int, inter: int,
                       dtype: torch.dtype, transposed: bool = False) -> None:
        """transposed: float weights stored [E, K, N] (logical)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer) -> None:
        """Once every expert is in: quantize, pack, free what the kernels do not read."""

    def grouped(self, layer, proj: str, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [S, K] sorted by expert (counts[e] rows each) -> [S, N]: the CPU grouped path."""
        raise NotImplementedError

    def expert_linear(self, layer, proj: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's projection of its rows (the per-expert reference loop)."""
        raise NotImplementedError

    def dense(self, layer, proj: str) -> torch.Tensor:
        """[E, N, K] fp32: the weights this layer multiplies by (tests, benchmarks)."""
        raise NotImplementedError

    def extra_bytes(self, layer) -> int:
        """Memory held beyond the layer's parameters (packed per-expert copies)."""
        return 0


def _shapes(proj: str, num_experts: int, hidden: int, inter: int) -> tuple[int, int, int]:
    return (num_experts, 2 * inter, hidden) if proj == "w13" else (num_experts, hidden, inter)


def _loop(fn, x: torch.Tensor, counts: list[int], n: int) -> torch.Tensor:
    out = x.new_empty(x.shape[0], n)
    start = 0
    for e, c in enumerate(counts):
        if c:
            out[start:start + c] = fn(e, x[start:start + c])
            start += c
    return out


class FloatExperts(ExpertsMethod):
    """fp32 multiplies with F.grouped_mm, one call per projection over all experts: the op
    transformers' own default experts call, so the float32 sums are the same. bf16 on CPU
    multiplies each expert's rows with its oneDNN-packed weight (native/packed_linear.py):
    1.2-2.5x faster than grouped_mm there (benchmarks/moe.py), bit-identical."""

    kind = "float"

    def create_weights(self, layer, num_experts, hidden, inter, dtype, transposed=False):
        for proj in PROJECTIONS:
            _param(layer, f"{proj}_weight", _shapes(proj, num_experts, hidden, inter), dtype,
                   proj, "rows" if proj == "w13" else "cols", transposed)
        layer.packed_experts = None

    def process_weights_after_loading(self, layer):
        w13, w2 = logical(layer.w13_weight), logical(layer.w2_weight)
        if w13.device.type == "cpu" and packed_linear.supported(w13):
            packed = {p: [packed_linear.pack(w[e].contiguous()) for e in range(w.shape[0])]
                      for p, w in (("w13", w13), ("w2", w2))}
            if all(t is not None for ts in packed.values() for t in ts):
                layer.packed_experts = packed

    def grouped(self, layer, proj, x, counts):
        w = logical(getattr(layer, f"{proj}_weight"))
        if layer.packed_experts is not None:
            packs = layer.packed_experts[proj]
            return _loop(lambda e, rows: packed_linear.linear(rows, packs[e], None), x, counts,
                         w.shape[1])
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return grouped_mm(x, w, offsets, counts)

    def expert_linear(self, layer, proj, expert, x):
        return F.linear(x, logical(getattr(layer, f"{proj}_weight"))[expert])

    def dense(self, layer, proj):
        return logical(getattr(layer, f"{proj}_weight")).float()

    def extra_bytes(self, layer):
        if layer.packed_experts is None:
            return 0
        return sum(t.numel() * t.element_size() for ts in layer.packed_experts.values()
                   for t in ts)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
               counts: list[int]) -> torch.Tensor:
    """x [S, K] sorted by expert, w [E, N, K] -> [S, N]: torch's grouped matmul where this
    torch has one, else one torch.mm per expert."""
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(x, w.transpose(1, 2), offs=offsets)
    return _loop(lambda e, rows: rows @ w[e].T, x, counts, w.shape[1])


class _QuantizedExperts(ExpertsMethod):
    """int8 / int4 weight-only experts: the canonical tensors per projection, one kernel per
    expert on the CPU (the native kernels pack their own copy, so the canonical tensors are
    then freed), the stacked canonical tensors themselves on CUDA."""

    def __init__(self, group_size: int | None, from_float: bool, exact: bool) -> None:
        self.group_size, self.from_float, self.exact = group_size, from_float, exact

    def create_weights(self, layer, num_experts, hidden, inter, dtype, transposed=False):
        layer.quant_groups = {}
        for proj in PROJECTIONS:
            e, n, k = _shapes(proj, num_experts, hidden, inter)
            group = self.group_size or k
            qf.check_group(f"{layer.prefix}.{proj} ({self.kind})", k, group)
            layer.quant_groups[proj] = group
            split = "rows" if proj == "w13" else "cols"
            if self.from_float:  # quantized once loaded, into [E, N, K]
                _param(layer, f"{proj}_weight", (e, n, k), dtype, proj, split, transposed)
            else:
                self.create_quantized(layer, proj, e, n, k, group, split)
        layer.expert_kernels = None

    def create_quantized(self, layer, proj, e, n, k, group, split):
        raise NotImplementedError

    def quantize(self, w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def make_kernel(self, *tensors) -> quant_kernels.Kernel:
        raise NotImplementedError

    def dequantize(self, *tensors) -> torch.Tensor:
        raise NotImplementedError

    def canonical(self, layer, proj: str) -> list[torch.Tensor]:
        return [getattr(layer, f"{proj}_{n}").data for n in self.tensor_names]

    def process_weights_after_loading(self, layer):
        for proj in PROJECTIONS if self.from_float else ():
            w = logical(getattr(layer, f"{proj}_weight"))
            per_expert = [self.quantize(w[e], layer.quant_groups[proj]) for e in range(w.shape[0])]
            delattr(layer, f"{proj}_weight")
            split = "rows" if proj == "w13" else "cols"
            for i, name in enumerate(self.tensor_names):
                t = torch.stack([q[i] for q in per_expert])
                _param(layer, f"{proj}_{name}", tuple(t.shape), t.dtype, proj, split).data = t
        if layer.w13_qweight.device.type != "cpu":
            return  # the Triton kernel reads the canonical tensors
        layer.expert_kernels = {
            proj: [self.make_kernel(*(t[e] for t in self.canonical(layer, proj)))
                   for e in range(layer.num_experts)] for proj in PROJECTIONS}
        if (all(k.owns_weights for ks in layer.expert_kernels.values() for k in ks)
                and not getattr(layer, "keep_canonical", False)):
            for proj in PROJECTIONS:  # each kernel keeps its own packed copy
                for name in self.tensor_names:
                    p = getattr(layer, f"{proj}_{name}")
                    p.data = p.data.new_empty(0)

    def grouped(self, layer, proj, x, counts):
        kernels = layer.expert_kernels[proj]
        n = 2 * layer.intermediate_size if proj == "w13" else layer.hidden_size
        return _loop(lambda e, rows: kernels[e](rows), x, counts, n)

    def expert_linear(self, layer, proj, expert, x):
        if layer.expert_kernels is not None:
            return layer.expert_kernels[proj][expert](x)
        return (x.float() @ self.dense(layer, proj)[expert].T).to(x.dtype)

    def dense(self, layer, proj):
        if layer.expert_kernels is not None:
            return torch.stack([k.dequantize() for k in layer.expert_kernels[proj]])
        tensors = self.canonical(layer, proj)
        return torch.stack([self.dequantize(*(t[e] for t in tensors))
                            for e in range(tensors[0].shape[0])])

    def extra_bytes(self, layer):
        if layer.expert_kernels is None:
            return 0
        return sum(k.extra_bytes() for ks in layer.expert_kernels.values() for k in ks)


class Int8Experts(_QuantizedExperts):
    kind = qf.INT8
    tensor_names = ("qweight", "scales")

    def create_quantized(self, layer, proj, e, n, k, group, split):
        _param(layer, f"{proj}_qweight", (e, n, k), torch.int8, proj, split)
        _param(layer, f"{proj}_scales", (e, n, k // group), torch.float32, proj, split)

    def quantize(self, w, group):
        return qf.quantize_int8(w, group)

    def make_kernel(self, qweight, scales):
        return quant_kernels.int8_kernel(qweight.contiguous(), scales.contiguous(),
                                         exact=self.exact)

    def dequantize(self, qweight, scales):
        return qf.dequantize_int8(qweight, scales)


class Int4Experts(_QuantizedExperts):
    kind = qf.INT4
    tensor_names = ("qweight", "scales", "zeros")

    def create_quantized(self, layer, proj, e, n, k, group, split):
        if k % 2:
            raise ValueError(f"{layer.prefix}.{proj}: int4 needs an even input size, got {k}")
        _param(layer, f"{proj}_qweight", (e, n, k // 2), torch.uint8, proj, split)
        _param(layer, f"{proj}_scales", (e, n, k // group), torch.float32, proj, split)
        _param(layer, f"{proj}_zeros", (e, n, k // group), torch.float32, proj, split)

    def quantize(self, w, group):
        return qf.quantize_int4(w, group)

    def make_kernel(self, qweight, scales, zeros):
        return quant_kernels.int4_kernel(qweight.contiguous(), scales.contiguous(),
                                         zeros.contiguous(), exact=self.exact)

    def dequantize(self, qweight, scales, zeros):
        return qf.dequantize_int4(qweight, scales, zeros)


def experts_method(quant_config: QuantConfig | None, layer: nn.Module,
                   prefix: str) -> ExpertsMethod:
    """The experts' format, from the LinearMethod the config picks for their prefix."""
    method = (quant_config or NO_QUANT).method_for(layer, prefix)
    if type(method) is FloatLinearMethod:
        return FloatExperts()
    if isinstance(method, (Int8LinearMethod, Int4LinearMethod)):
        cls = Int8Experts if isinstance(method, Int8LinearMethod) else Int4Experts
        return cls(method.group_size, method.from_float, method.exact)
    raise ValueError(f"{prefix}: quant method {type(method).__name__} is not supported for "
                     "MoE experts; supported: float, int8, int4 (weight-only)")
