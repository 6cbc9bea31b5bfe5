"""Phi-3 (and Phi-3.5 / Phi-4-mini): Llama's layer with fused qkv and gate_up projections in the
checkpoint (split into the usual parts on load, so tensor parallelism and LoRA shard them by
the usual rules), partial rotary (`partial_rotary_factor`), LongRoPE scaling (a short and a
long table, picked per token as transformers does) and a sliding window on every layer."""

from __future__ import annotations

from quire.models.decoder import GLOBAL_ROPE
from quire.models.llama import LlamaForCausalLM
from quire.models.rope import RotaryEmbedding


class Phi3ForCausalLM(LlamaForCausalLM):
    def _split_parts(self, module):
        cfg = self.cfg
        if module == "self_attn.qkv_proj":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [(0, q, "self_attn.q_proj"), (q, kv, "self_attn.k_proj"),
                    (q + kv, kv, "self_attn.v_proj")]
        if module == "mlp.gate_up_proj":
            n = cfg.intermediate_size
            return [(0, n, "mlp.gate_proj"), (n, n, "mlp.up_proj")]
        return None

    def make_ropes(self, max_model_len, dtype, device):
        cfg = self.cfg
        params = getattr(cfg.hf, "rope_parameters", None) or {}
        factor = params.get("partial_rotary_factor",
                            getattr(cfg.hf, "partial_rotary_factor", 1.0))
        return {GLOBAL_ROPE: RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
            max_model_len, dtype, device, rotary_dim=int(cfg.head_dim * factor),
            hf_config=cfg.hf)}
