"""Linear layers that own their weight format, their tensor-parallel shard, and their loading.

A model file only says which kind of linear each projection is:

    ColumnParallelLinear       output dim split across ranks; the output stays split
    MergedColumnParallelLinear several column-parallel outputs fused into one matmul, each
                               split on its own (gate/up: by intermediate size)
    QKVParallelLinear          fused q/k/v split by attention heads; KV heads replicated when
                               there are fewer of them than ranks
    RowParallelLinear          input dim split; the partial products are all-reduced

(the vocabulary-parallel embedding and LM head are in `vocab_parallel.py`). Each layer
delegates its weight format to a quant method (`quantization.py`: float now), and loading to
`weight_loader(param, loaded, shard_id)`, which takes the *full* checkpoint tensor (or a lazy
safetensors slice) and keeps only this rank's shard, so a rank reads only its part.

At tensor-parallel size 1 every layer computes exactly F.linear(x, W, b) on the same fused
weight as before these layers existed: bit-identical outputs.

Extension points:
- quant methods: pass a `QuantConfig` (`quant_config=`) to the model; it chooses a
  `LinearMethod` per layer by prefix. Nothing here or in the model file changes.
- LoRA: `self.lora` is the slot for a batched adapter delta (None now). It will hold the
  stacked A/B of the loaded adapters, sharded the way this layer is (column-parallel: B split
  on the output dim; row-parallel: A split on the input dim, the delta added before the
  all-reduce), and `forward` adds `self.lora.apply(x, y)` to the base output. A fused layer
  knows its output parts (`output_sizes`), which is what a per-part adapter needs.
"""

from __future__ import annotations

import torch
from torch import nn

from quire import parallel_state as ps
from quire.layers.quantization import NO_QUANT, QuantConfig
from quire.layers.weights import materialize, narrow
from quire.native.fused_ops import silu_and_mul


class LinearBase(nn.Module):
    """in_features / out_features are this rank's (local) sizes."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.in_features, self.out_features = in_features, out_features
        self.prefix = prefix
        self.quant_method = (quant_config or NO_QUANT).method_for(self, prefix)
        self.quant_method.create_weights(self, in_features, out_features,
                                         torch.get_default_dtype())
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.output_dim = 0
        else:
            self.bias = None
        self.lora = None  # see the module docstring
        self.weights_processed = False  # see process_weights_after_loading

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        if self.lora is not None:
            y = self.lora.apply(x, y)
        return y

    def process_weights_after_loading(self) -> None:
        """Once per layer: the model loader calls it as soon as the layer's last weight is in
        (so a float checkpoint quantized on load never sits whole in memory), pack_weights
        after the load for the rest."""
        if self.weights_processed:
            return
        self.quant_method.process_weights_after_loading(self)
        self.weights_processed = True

    # --- loading -------------------------------------------------------------------------
    def shard_ranges(self, param: nn.Parameter, shard_id) -> dict[int, tuple[int, int, int]]:
        """dim -> (start in the checkpoint tensor, length, start in param) for each dim of
        param that is split; overridden per kind of layer."""
        return {}

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        custom = getattr(param, "weight_loader", None)
        if custom is not None:  # a quant method whose format needs its own slicing
            custom(self, param, loaded, shard_id)
            return
        target = param.data
        for dim, (start, length, dst) in self.shard_ranges(param, shard_id).items():
            loaded = narrow(loaded, dim, start, length)
            target = target.narrow(dim, dst, length)
        loaded = materialize(loaded)
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(f"weight {self.prefix} ({shard_id or 'whole'}) has shape "
                             f"{tuple(loaded.shape)} for this rank's shard, the config "
                             f"implies {tuple(target.shape)}")
        target.copy_(loaded)


def _dim(param, name: str) -> int | None:
    return getattr(param, name, None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        size = ps.tp_size()
        if out_features % size:
            raise ValueError(f"tensor_parallel_size ({size}) must divide {prefix}'s output "
                             f"size ({out_features})")
        super().__init__(in_features, out_features // size, bias, quant_config, prefix)

    def shard_ranges(self, param, shard_id):
        dim = _dim(param, "output_dim")
        if dim is None or self.tp_size == 1:
            return {}
        n = param.shape[dim]
        return {dim: (self.tp_rank * n, n, 0)}


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Outputs [part 0 | part 1 | ...] in one matmul; the checkpoint has each part on its own
    (shard_id = the part's index), and each part is split across ranks separately."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        size = ps.tp_size()
        for s in output_sizes:
            if s % size:
                raise ValueError(f"tensor_parallel_size ({size}) must divide each of "
                                 f"{prefix}'s output sizes {output_sizes}")
        self.output_sizes = [s // size for s in output_sizes]  # local
        super().__init__(in_features, sum(output_sizes), bias, quant_config, prefix)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(self(x)) for a gated MLP's [gate | up]: in one pass where the layer's
        kernel fuses the activation into its matmul (bit for bit the same), else two steps."""
        kernel = getattr(self, "quant_kernel", None) or getattr(self, "native_kernel", None)
        fused = getattr(kernel, "silu_and_mul", None)
        if (fused is not None and self.lora is None and self.bias is None
                and len(self.output_sizes) == 2 and self.output_sizes[0] == self.output_sizes[1]):
            y = fused(x)
            if y is not None:
                return y
        return silu_and_mul(self(x))

    def shard_ranges(self, param, shard_id):
        dim = _dim(param, "output_dim")
        if dim is None:
            return {}
        if shard_id is None:
            raise ValueError(f"{self.prefix} is fused; load it part by part")
        n = self.output_sizes[shard_id]
        return {dim: (self.tp_rank * n, n, sum(self.output_sizes[:shard_id]))}


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v in one matmul: each rank keeps its query heads and the KV heads they use."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant_config: QuantConfig | None = None,
                 prefix: str = "") -> None:
        self.head_dim = head_dim
        self.num_heads = ps.heads_per_rank(num_heads)            # local
        self.num_kv_heads = ps.kv_heads_per_rank(num_kv_heads)   # local
        self.kv_head_start = ps.kv_head_start(num_kv_heads)
        self.output_sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim,
                             self.num_kv_heads * head_dim]
        LinearBase.__init__(self, hidden_size, sum(self.output_sizes), bias, quant_config,
                            prefix)

    _PARTS = {"q": 0, "k": 1, "v": 2}

    def shard_ranges(self, param, shard_id):
        dim = _dim(param, "output_dim")
        if dim is None:
            return {}
        part = self._PARTS[shard_id]
        n = self.output_sizes[part]
        first_head = self.tp_rank * self.num_heads if part == 0 else self.kv_head_start
        return {dim: (first_head * self.head_dim, n, sum(self.output_sizes[:part]))}


class RowParallelLinear(LinearBase):
    """Input dim split; y = all_reduce(x_shard @ W_shard^T) + b (the bias added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        size = ps.tp_size()
        if in_features % size:
            raise ValueError(f"tensor_parallel_size ({size}) must divide {prefix}'s input "
                             f"size ({in_features})")
        super().__init__(in_features // size, out_features, bias, quant_config, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)  # exactly F.linear(x, W, b)
        y = self.quant_method.apply(self, x, None)
        if self.lora is not None:
            y = self.lora.apply(x, y)
        ps.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def shard_ranges(self, param, shard_id):
        dim = _dim(param, "input_dim")
        if dim is None or self.tp_size == 1:
            return {}
        n = param.shape[dim]
        return {dim: (self.tp_rank * n, n, 0)}
