"""Qwen3 (dense): Llama's layer with an RMS norm over each head of q and k before rope."""

from __future__ import annotations

from quire.layers.norms import RMSNorm, head_norm
from quire.models.llama import DecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, cfg, backend, quant_config, prefix) -> None:
        super().__init__(cfg, backend, quant_config, prefix)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qk_norm(self, q, k):
        # per head, so each tensor-parallel rank norms its own heads with the same weight
        return head_norm(self.q_norm, q), head_norm(self.k_norm, k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    _LAYER_NORMS = {**LlamaForCausalLM._LAYER_NORMS,
                    "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}

    def make_layer(self, index, quant_config):
        cfg = self.cfg
        return Qwen3DecoderLayer(cfg, self.backend(cfg.sliding_windows[index]), quant_config,
                                 f"layers.{index}")
