"""Granite: Llama with four multipliers (embedding, residual, attention scale, logits)."""

from __future__ import annotations

from quire.models.llama import DecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(DecoderLayer):
    def __init__(self, cfg, backend, quant_config, prefix, residual_multiplier: float) -> None:
        super().__init__(cfg, backend, quant_config, prefix)
        self.residual_multiplier = residual_multiplier

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        """transformers adds `residual + out * multiplier` after attention and after the MLP;
        the adds are fused into the norms that follow, so each output is scaled first."""
        t = x.shape[0]
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        o = self._attention(h, t, cos, sin, k_cache, v_cache, meta)
        h = self.post_attention_layernorm(o * self.residual_multiplier, residual)
        return self._mlp(h) * self.residual_multiplier, residual


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
