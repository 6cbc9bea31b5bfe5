"""OLMo 2: norms after attention and after the MLP (none before), and q/k RMS norms over the
whole projection, not per head: under tensor parallelism their mean of squares is summed
across the ranks (layers/norms.py ShardedRMSNorm)."""

from __future__ import annotations

from quire import parallel_state as ps
from quire.layers.norms import RMSNorm, ShardedRMSNorm
from quire.models.llama import DecoderLayer, LlamaForCausalLM


class Olmo2DecoderLayer(DecoderLayer):
    def __init__(self, cfg, backend, quant_config, prefix) -> None:
        super().__init__(cfg, backend, quant_config, prefix)
        del self.input_layernorm  # OLMo 2 norms outputs, not inputs
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        d, rank, size = cfg.head_dim, ps.tp_rank(), ps.tp_size()
        q_first = rank * self.num_heads
        kv_first = ps.kv_head_start(cfg.num_kv_heads, rank, size)
        self.q_norm = ShardedRMSNorm(cfg.num_heads * d,
                                     list(range(q_first, q_first + self.num_heads)), d,
                                     cfg.rms_norm_eps)
        self.k_norm = ShardedRMSNorm(cfg.num_kv_heads * d,
                                     list(range(kv_first, kv_first + self.num_kv_heads)), d,
                                     cfg.rms_norm_eps)

    def qk_norm(self, q, k):
        t = q.shape[0]
        return (self.q_norm(q.reshape(t, -1)).view(q.shape),
                self.k_norm(k.reshape(t, -1)).view(k.shape))

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        """Keeps its own residual stream: returns (the layer's output, None)."""
        x = x + self.post_attention_layernorm(
            self._attention(x, x.shape[0], cos, sin, k_cache, v_cache, meta))
        return x + self.post_feedforward_layernorm(self._mlp(x)), None


class Olmo2ForCausalLM(LlamaForCausalLM):
    keeps_own_residual = True  # its layers return residual None

    _LAYER_NORMS = {"post_attention_layernorm": "post_attention_layernorm",
                    "post_feedforward_layernorm": "post_feedforward_layernorm",
                    "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}

    def make_layer(self, index, quant_config):
        cfg = self.cfg
        return Olmo2DecoderLayer(cfg, self.backend(cfg.sliding_windows[index]), quant_config,
                                 f"layers.{index}")
