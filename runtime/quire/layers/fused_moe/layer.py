"""FusedMoE: a mixture-of-experts MLP as one layer, whatever the family.

    moe = FusedMoE(num_experts, top_k, hidden, intermediate, router=partial(softmax_topk, ...),
                   bias=..., activation="silu", quant_config=..., prefix="layers.3.mlp.experts")
    y = moe(x, router_logits)      # x [T, H], router_logits [T, E] -> [T, H]

The router's linear stays in the family's module (it is a small replicated matmul); this
layer routes (`router`: a function of the logits, routing.py), runs the experts and, under
tensor parallelism, all-reduces. Each rank holds every expert's slice of the intermediate
size (vLLM's default split): gate/up rows and down columns, so the down projection's partial
sums add up across ranks in the all-reduce; the down bias is added on rank 0 only.

Paths (`impl`): "auto" takes the Triton kernel on CUDA (triton_moe.py) and the grouped CPU
path elsewhere (grouped.py); "loop" is the per-expert reference (reference.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quire import parallel_state as ps
from quire.layers.fused_moe import activation as act
from quire.layers.fused_moe import grouped, reference
from quire.layers.fused_moe.experts import experts_method, logical
from quire.layers.quantization import QuantConfig
from quire.layers.weights import materialize, narrow, shape_of

IMPLS = ("auto", "grouped", "triton", "loop")
_PARTS = {"w1": 0, "w3": 1}  # gate, up: the two parts of w13


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 router: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                 bias: bool = False, activation: str = act.SILU, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, quant_config: QuantConfig | None = None,
                 prefix: str = "", transposed: bool = False) -> None:
        """transposed: float experts stored [E, K, N] as gpt-oss's checkpoints store them
        (experts.logical: transformers' exact float32 sums)."""
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: num_experts_per_tok ({top_k}) must be between 1 and "
                             f"the number of experts ({num_experts})")
        if activation not in act.ACTIVATIONS:
            raise ValueError(f"{prefix}: activation must be one of "
                             f"{', '.join(act.ACTIVATIONS)}, got {activation!r}")
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"tensor_parallel_size ({self.tp_size}) must divide {prefix}'s "
                             f"expert intermediate size ({intermediate_size})")
        self.num_experts, self.top_k, self.prefix = num_experts, top_k, prefix
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size // self.tp_size  # this rank's
        self.router = router
        self.activation, self.swiglu_alpha, self.swiglu_limit = (activation, swiglu_alpha,
                                                                 swiglu_limit)
        self.impl = "auto"
        self.method = experts_method(quant_config, self, prefix)
        dtype = torch.get_default_dtype()
        self.method.create_weights(self, num_experts, hidden_size, self.intermediate_size, dtype,
                                   transposed)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = self._bias(2 * self.intermediate_size, "w13", "rows", dtype)
            self.w2_bias = self._bias(hidden_size, "w2", None, dtype)
        self.adds_w2_bias = self.tp_rank == 0  # the all-reduce sums the others' outputs
        self._loaded: dict[str, set] = {}
        self.weights_processed = False

    def _bias(self, n: int, proj: str, split: str | None, dtype) -> nn.Parameter:
        p = nn.Parameter(torch.empty(self.num_experts, n, dtype=dtype), requires_grad=False)
        p.moe_proj, p.moe_split = proj, split
        return p

    # --- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.router(router_logits)
        out = self.experts(x, topk_weights, topk_ids)
        if self.tp_size > 1:
            ps.all_reduce(out)
        return out

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts alone, routing given: [T, H] -> [T, H], before the all-reduce."""
        impl = self.impl
        if impl == "auto":
            impl = "triton" if x.is_cuda else "grouped"
        if impl == "loop":
            return reference.experts_loop(self, x, topk_weights, topk_ids)
        if impl == "grouped":
            return grouped.fused_experts(self, x, topk_weights, topk_ids)
        if impl == "triton":
            from quire.layers.fused_moe import triton_moe  # imports triton: CUDA (or tests)
            return triton_moe.fused_experts(self, x, topk_weights, topk_ids)
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")

    # --- weights -------------------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded, expert_id: int | None = None,
                      shard_id: str | None = None) -> None:
        """`loaded`: one expert's checkpoint tensor (expert_id given) or all experts stacked
        [E, ...] (expert_id None), in the [N, K] layout of its projection (the family
        transposes and de-interleaves fused checkpoints first); shard_id "w1" (gate), "w3"
        (up) for w13's parameters, "w2" (or None) for w2's. Keeps this rank's shard."""
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        target = logical(param)
        target = target if expert_id is None else target[expert_id]
        lead = 1 if expert_id is None else 0  # the expert dim, when stacked
        want = list(target.shape)  # the checkpoint's shape: this rank's, unsplit
        if param.moe_split == "rows":
            if shard_id not in _PARTS:
                raise ValueError(f"{self.prefix}.{name}: shard_id must be 'w1' (gate) or 'w3' "
                                 f"(up), got {shard_id!r}")
            n = target.shape[lead] // 2
            want[lead] = n * self.tp_size
        elif param.moe_split == "cols" and target.dim() - lead == 2:
            n = target.shape[lead + 1]
            want[lead + 1] = n * self.tp_size
        if list(shape_of(loaded)) != want:
            which = "all experts" if expert_id is None else f"expert {expert_id}"
            raise ValueError(f"weight {self.prefix}.{name} ({which}, {shard_id or 'whole'}) has "
                             f"shape {shape_of(loaded)}, the config implies {tuple(want)}")
        if param.moe_split == "rows":
            loaded = narrow(loaded, lead, self.tp_rank * n, n)
            target = target.narrow(lead, _PARTS[shard_id] * n, n)
        elif param.moe_split == "cols" and target.dim() - lead == 2:
            loaded = narrow(loaded, lead + 1, self.tp_rank * n, n)
        loaded = materialize(loaded)
        target.copy_(loaded)
        experts = range(self.num_experts) if expert_id is None else (expert_id,)
        self._loaded.setdefault(name, set()).update((e, shard_id) for e in experts)
        if self.loaded_completely():  # quantize / pack now: the float experts go at once
            self.process_weights_after_loading()

    def loaded_completely(self) -> bool:
        if self.weights_processed:  # only a complete layer is (its parameters may be new)
            return True
        for name, p in self.named_parameters(recurse=False):
            parts = 2 if p.moe_split == "rows" else 1
            if len(self._loaded.get(name, ())) < parts * self.num_experts:
                return False
        return True

    def missing_weights(self) -> list[str]:
        if self.weights_processed:
            return []
        return [f"{self.prefix}.{n}" for n, p in self.named_parameters(recurse=False)
                if len(self._loaded.get(n, ())) < (2 if p.moe_split == "rows" else 1)
                * self.num_experts]

    def process_weights_after_loading(self) -> None:
        if self.weights_processed:
            return
        self.method.process_weights_after_loading(self)
        self.weights_processed = True

    def extra_weight_bytes(self) -> int:
        """Held beyond the parameters (per-expert packed copies): model_builder counts it."""
        return self.method.extra_bytes(self)

    def dense_weights(self, proj: str) -> torch.Tensor:
        """[E, N, K] fp32 of w13 or w2: what this rank multiplies by (tests, benchmarks)."""
        return self.method.dense(self, proj)
