"""The model's total and active parameters, counted from the checkpoint as it loads (shapes
only: a lazy slice is not read for it), so the figure is the whole model's on every rank and
at any tensor-parallel size. Active: what one token runs through, i.e. each MoE layer's
experts times top_k / num_experts (a dense model's active count is its total). A tied LM head
is stored once and counted once; a quantized checkpoint's tensors count as stored elements."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from torch import nn

from quire.layers.weights import shape_of


class ParameterCount:
    def __init__(self) -> None:
        self.total = 0
        self.experts = 0

    def counted(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        for name, tensor in weights:
            n = math.prod(shape_of(tensor))
            self.total += n
            if ".experts." in name:
                self.experts += n
            yield name, tensor

    def active(self, model: nn.Module) -> int:
        from quire.layers.fused_moe import FusedMoE
        moe = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
        if moe is None:
            return self.total
        return self.total - self.experts + round(self.experts * moe.top_k / moe.num_experts)

    def describe(self, model: nn.Module) -> str:
        """'46.70B parameters, 12.88B active per token (8 experts, 2 per token)'."""
        from quire.layers.fused_moe import FusedMoE
        moe = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
        text = f"{_human(self.total)} parameters"
        if moe is not None:
            text += (f", {_human(self.active(model))} active per token ({moe.num_experts} "
                     f"experts, {moe.top_k} per token)")
        return text


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
