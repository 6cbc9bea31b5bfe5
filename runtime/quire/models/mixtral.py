"""Mixtral: Mistral's attention, every MLP a mixture of experts with top-2 softmax routing
(weights renormalized over the chosen experts, kept in float32), experts `w1` (gate), `w3`
(up), `w2` (down) under `block_sparse_moe`."""

from __future__ import annotations

import functools

from quire.layers.fused_moe import softmax_topk
from quire.models.llama import LlamaForCausalLM
from quire.models.moe import MoECausalLM


class MixtralForCausalLM(MoECausalLM):
    _EXPERTS = "block_sparse_moe.experts"
    _EXPERT_PROJ = {"w1": "w1", "w3": "w3", "w2": "w2"}
    _PLAIN = {**LlamaForCausalLM._PLAIN, "block_sparse_moe.gate": "router"}

    def moe_layer(self, index):
        hf = self.cfg.hf
        return dict(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                    intermediate_size=hf.intermediate_size,
                    router=functools.partial(softmax_topk, top_k=hf.num_experts_per_tok,
                                             renormalize=True))

    def window(self, index):
        return getattr(self.cfg.hf, "sliding_window", None)  # every layer, where set
