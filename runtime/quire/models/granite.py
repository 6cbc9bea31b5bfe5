"""Granite: Llama with four multipliers (embedding, residual, attention scale, logits)."""

from __future__ import annotations

from quire.models.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, cfg, backend, quant_config, prefix, residual_multiplier: float) -> None:
        super().__init__(cfg, backend, quant_config, prefix)
        self.residual_multiplier = residual_multiplier

    # transformers adds `residual + out * multiplier` after attention and after the MLP;
    # Llama's layer fuses those adds into the norms that follow, so each output is scaled
    def _attention(self, h, t, cos, sin, k_cache, v_cache, meta):
        return super()._attention(h, t, cos, sin, k_cache, v_cache, meta) \
            * self.residual_multiplier

    def _mlp(self, h):
        return super()._mlp(h) * self.residual_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    def make_layer(self, index, quant_config):
        cfg = self.cfg
        return GraniteDecoderLayer(
            cfg, self.backend(cfg.sliding_windows[index], scale=cfg.hf.attention_multiplier),
            quant_config, f"layers.{index}", cfg.hf.residual_multiplier)

    def embed(self, input_ids):
        return self.embed_tokens(input_ids) * self.cfg.hf.embedding_multiplier

    def scale_logits(self, logits):
        return logits / self.cfg.hf.logits_scaling
