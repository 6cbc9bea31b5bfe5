"""What the mixture-of-experts families share: a router, a decoder layer whose MLP is a
FusedMoE (or dense, where the family says), and the loading of expert tensors.

A family subclasses `MoECausalLM` and says: which layers are sparse and how they route
(`moe_layer`), where its experts sit in the checkpoint (`_EXPERTS`, `_EXPERT_PROJ`) and
what its router is called (in `_PLAIN`). Expert tensors come one expert at a time
(`<experts>.<e>.<proj>.<kind>`, transformers' saved form) or stacked (`<experts>.gate_up_proj`
[E, 2I, H] and `<experts>.down_proj` [E, H, I], transformers' in-memory form); each FusedMoE
keeps its own shard and says what it still lacks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from quire.layers.fused_moe import FusedMoE
from quire.layers.weights import narrow, shape_of
from quire.models.llama import DecoderLayer, LlamaForCausalLM


class Router(nn.Module):
    """The router's linear: replicated on every rank, and always float (a quantized router
    would send tokens to other experts)."""

    def __init__(self, num_experts: int, hidden_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias
                     else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MoEDecoderLayer(DecoderLayer):
    """Llama's decoder layer; where `moe` (FusedMoE's keywords) is given, its MLP is the
    router and the experts instead of the dense gate/up and down projections."""

    def __init__(self, cfg, backend, quant_config, prefix: str, moe: dict | None,
                 router_bias: bool = False) -> None:
        super().__init__(cfg, backend, quant_config, prefix)
        self.router = self.experts = None
        if moe is None:
            return
        del self.gate_up_proj, self.down_proj
        self.router = Router(moe["num_experts"], cfg.hidden_size, router_bias)
        self.experts = FusedMoE(hidden_size=cfg.hidden_size, quant_config=quant_config,
                                prefix=f"{prefix}.mlp.experts", **moe)

    def _mlp(self, h):
        if self.experts is None:
            return super()._mlp(h)
        return self.experts(h, self.router(h))


class MoECausalLM(LlamaForCausalLM):
    _EXPERTS = "mlp.experts"   # the experts' module in the checkpoint, within a layer
    _EXPERT_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    _PLAIN = {**LlamaForCausalLM._PLAIN, "mlp.gate": "router"}  # the router, by its name

    def moe_layer(self, index: int) -> dict | None:
        """FusedMoE's keywords for layer `index` (num_experts, top_k, intermediate_size,
        router, ...), or None for a dense layer."""
        raise NotImplementedError

    def window(self, index: int) -> int | None:
        return self.cfg.sliding_windows[index]

    def make_layer(self, index, quant_config):
        return MoEDecoderLayer(self.cfg, self.backend(self.window(index)), quant_config,
                               f"layers.{index}", self.moe_layer(index))

    # --- weights -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """The experts' tensors go to their FusedMoE (`_load_special`, which processes itself
        once complete); the rest to the shared loader, which checks only what it loads."""
        super().load_weights(weights)
        missing = [n for m in self.modules() if isinstance(m, FusedMoE)
                   for n in m.missing_weights()]
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(f"the checkpoint lacks the experts' weights {shown}")

    def _load_special(self, name: str, tensor) -> bool:
        """Loads an expert tensor (True), or leaves the name to the shared loader (False)."""
        parsed = _layer_part(name, self._EXPERTS + ".")
        if parsed is None:
            return False
        layer, rest = parsed
        if not self.stage.owns(layer):
            return True  # another pipeline stage's
        experts = self.layers[layer].experts
        if experts is None:
            raise ValueError(f"{name}: layer {layer} is dense in this config, but the "
                             "checkpoint has experts for it")
        self.load_experts(experts, rest, tensor, name)
        return True

    def load_experts(self, experts: FusedMoE, rest: str, tensor, name: str) -> None:
        """rest: the name after the experts' module ("3.gate_proj.weight" or
        "gate_up_proj")."""
        head, _, kind = rest.partition(".")
        if head.isdigit():  # one expert: <e>.<proj>.<kind>
            proj, _, kind = kind.partition(".")
            if proj not in self._EXPERT_PROJ:
                raise ValueError(f"{name}: unknown expert projection {proj!r}; expected one "
                                 f"of {', '.join(self._EXPERT_PROJ)}")
            shard = self._EXPERT_PROJ[proj]
            param = _expert_param(experts, "w2" if shard == "w2" else "w13", kind, name)
            experts.weight_loader(param, tensor, int(head), shard)
        elif rest == "gate_up_proj":  # stacked [E, 2I, H]: [gate | up]
            rows = shape_of(tensor)[1] // 2
            for shard, first in (("w1", 0), ("w3", rows)):
                experts.weight_loader(experts.w13_weight, narrow(tensor, 1, first, rows),
                                      None, shard)
        elif rest == "down_proj":
            experts.weight_loader(experts.w2_weight, tensor, None, "w2")
        else:
            raise ValueError(f"{name}: not an expert tensor this loader knows")


def _layer_part(name: str, module: str) -> tuple[int, str] | None:
    """'model.layers.3.mlp.experts.0.w1.weight', 'mlp.experts.' -> (3, '0.w1.weight')."""
    name = name.removeprefix("model.")
    if not name.startswith("layers."):
        return None
    _, idx, rest = name.split(".", 2)
    if not rest.startswith(module):
        return None
    return int(idx), rest[len(module):]


def _expert_param(experts: FusedMoE, proj: str, kind: str, name: str) -> nn.Parameter:
    param = getattr(experts, f"{proj}_{kind}", None)
    if not isinstance(param, nn.Parameter):
        kinds = sorted({n.split("_", 1)[1] for n, _ in experts.named_parameters(recurse=False)})
        raise ValueError(f"{name}: expert tensors of kind {kind!r} are not supported for "
                         f"{experts.method.kind} experts (they take {', '.join(kinds)}); "
                         "pre-quantized MoE checkpoints are not read: load a float one "
                         "(--quantization int8 or int4 quantizes its experts on load)")
    return param
