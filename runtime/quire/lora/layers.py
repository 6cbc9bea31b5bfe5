"""The LoRA slot stack of one linear layer: what `linear.lora` holds (see quire/layers/
linear.py), and how an adapter's PEFT modules are packed into it.

A fused layer (qkv_proj: q|k|v, gate_up_proj: gate|up) takes one PEFT module per output part.
Their A matrices sit side by side on the rank axis and their B matrices block-diagonally, so
that the delta of every part comes from one shrink and one expand:

    lora_a[slot]: [in, parts x max_rank]     x @ lora_a        -> u   (shrink)
    lora_b[slot]: [parts x max_rank, out]    u @ lora_b        -> dy  (expand, scaling folded in)

Ranks below max_rank are zero-padded (exact: the padding adds zeros). Under tensor parallelism
the adapter is sharded as the layer is, with the layer's own `shard_ranges`: column-parallel
layers keep their rows of B, row-parallel ones their columns of A (the delta is then added
before the all-reduce, in RowParallelLinear.forward).
"""

from __future__ import annotations

import torch

from quire.layers.linear import RowParallelLinear
from quire.lora.ops import add_lora
from quire.lora.peft_format import ModuleLoRA


class _ShapeOf:
    """Stands in for a parameter when asking a layer which part of a tensor is its shard."""

    def __init__(self, shape: tuple[int, ...], **dims: int) -> None:
        self.shape = shape
        self.__dict__.update(dims)


class LoRALinear:
    def __init__(self, layer, parts: list[tuple[str, object]], max_loras: int, max_rank: int,
                 context, dtype: torch.dtype, device: torch.device) -> None:
        """parts: (transformers module name, the layer's shard id) per output part, in
        output order; context.batch is the current step's LoRABatch (or None)."""
        self.layer = layer
        self.parts = parts
        self.max_rank = max_rank
        self.context = context
        sizes = getattr(layer, "output_sizes", [layer.out_features])
        self.part_offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.part_sizes = sizes
        width = len(parts) * max_rank
        self.lora_a = torch.zeros(max_loras, layer.in_features, width, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, width, layer.out_features, dtype=dtype,
                                  device=device)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.context.batch
        if batch is None:  # no row of this step has an adapter
            return y
        return add_lora(y, x, self.lora_a, self.lora_b, batch)

    # --- packing -------------------------------------------------------------------------
    def pack(self, adapter_name: str, modules: dict[str, ModuleLoRA], layer_prefix: str,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's (lora_a, lora_b) for one adapter, on the host; None if the adapter
        targets none of its parts."""
        found = [(i, modules.get(f"{layer_prefix}.{name}"))
                 for i, (name, _) in enumerate(self.parts)]
        if all(m is None for _, m in found):
            return None
        r = self.max_rank
        a = torch.zeros(self.layer.in_features, len(self.parts) * r)
        b = torch.zeros(len(self.parts) * r, self.layer.out_features)
        for i, m in found:
            if m is None:
                continue
            name, shard_id = self.parts[i]
            lora_a = self._shard_input(m.lora_a, f"{layer_prefix}.{name}", adapter_name)
            lora_b, offset = self._shard_output(m.lora_b, i, shard_id,
                                                f"{layer_prefix}.{name}", adapter_name)
            a[:, i * r: i * r + m.rank] = lora_a.t()
            b[i * r: i * r + m.rank, offset: offset + lora_b.shape[0]] = lora_b.t() * m.scaling
        return a.to(dtype), b.to(dtype)

    def _shard_input(self, lora_a: torch.Tensor, module: str, adapter: str) -> torch.Tensor:
        if isinstance(self.layer, RowParallelLinear):
            like = _ShapeOf((lora_a.shape[0], self.layer.in_features), input_dim=1)
            for dim, (start, length, _) in self.layer.shard_ranges(like, None).items():
                lora_a = lora_a.narrow(dim, start, length)
        if lora_a.shape[1] != self.layer.in_features:
            raise ValueError(f"adapter {adapter!r}: {module} lora_A has input size "
                             f"{lora_a.shape[1]}, the model's is {self.layer.in_features}")
        return lora_a

    def _shard_output(self, lora_b: torch.Tensor, part: int, shard_id, module: str,
                      adapter: str) -> tuple[torch.Tensor, int]:
        offset, size = self.part_offsets[part], self.part_sizes[part]
        if not isinstance(self.layer, RowParallelLinear):
            like = _ShapeOf((size, lora_b.shape[1]), output_dim=0)
            ranges = self.layer.shard_ranges(like, shard_id)
            if 0 in ranges:
                start, length, offset = ranges[0]
                if start + length > lora_b.shape[0]:
                    raise ValueError(self._size_error(adapter, module, lora_b, part))
                lora_b = lora_b.narrow(0, start, length)
        if lora_b.shape[0] != size:
            raise ValueError(self._size_error(adapter, module, lora_b, part))
        return lora_b, offset

    @staticmethod
    def _size_error(adapter, module, lora_b, part) -> str:
        return (f"adapter {adapter!r}: {module} lora_B has {lora_b.shape[0]} output rows, "
                f"which do not match the model's {module.rsplit('.', 1)[-1]}")

    # --- slots ---------------------------------------------------------------------------
    def set_slot(self, slot: int, packed: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if packed is None:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
        else:
            self.lora_a[slot].copy_(packed[0], non_blocking=True)
            self.lora_b[slot].copy_(packed[1], non_blocking=True)
