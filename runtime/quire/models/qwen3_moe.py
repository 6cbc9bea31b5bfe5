"""Qwen3-MoE: Qwen3's attention (an RMS norm over each head of q and k), MLPs that are
mixtures of experts except where `mlp_only_layers` or `decoder_sparse_step` make them dense;
top-k softmax routing, renormalized over the chosen experts where `norm_topk_prob`, the
weights cast back to the logits' dtype."""

from __future__ import annotations

import functools

import torch

from quire.layers.fused_moe import softmax_topk
from quire.layers.norms import RMSNorm, head_norm
from quire.models.moe import MoECausalLM, MoEDecoderLayer
from quire.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    def __init__(self, cfg, backend, quant_config, prefix, moe) -> None:
        super().__init__(cfg, backend, quant_config, prefix, moe)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qk_norm(self, q, k):
        return head_norm(self.q_norm, q), head_norm(self.k_norm, k)


class Qwen3MoeForCausalLM(MoECausalLM):
    _LAYER_NORMS = Qwen3ForCausalLM._LAYER_NORMS

    def is_sparse(self, index: int) -> bool:
        hf = self.cfg.hf
        return (index not in (hf.mlp_only_layers or []) and hf.num_experts > 0
                and (index + 1) % hf.decoder_sparse_step == 0)

    def moe_layer(self, index):
        if not self.is_sparse(index):
            return None
        hf = self.cfg.hf
        dtype = torch.get_default_dtype()  # the model's, so the router logits'
        return dict(num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
                    intermediate_size=hf.moe_intermediate_size,
                    router=functools.partial(softmax_topk, top_k=hf.num_experts_per_tok,
                                             renormalize=hf.norm_topk_prob,
                                             weights_dtype=dtype))

    def window(self, index):
        return getattr(self.cfg.hf, "sliding_window", None)  # set only with use_sliding_window

    def make_layer(self, index, quant_config):
        return Qwen3MoeDecoderLayer(self.cfg, self.backend(self.window(index)), quant_config,
                                    f"layers.{index}", self.moe_layer(index))
