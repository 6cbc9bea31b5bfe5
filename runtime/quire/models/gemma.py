"""Gemma 2 and Gemma 3 (text): sandwich norms around attention and the MLP, Gemma's
(1 + weight) RMS norm, GeGLU, embeddings scaled by sqrt(hidden), queries scaled by
query_pre_attn_scalar, alternating sliding-window and global layers, and soft-capping of
attention scores and final logits where the config sets it. Gemma 3 adds q/k norms per head
and a rotary table per layer kind (local layers: their own theta; global: rope scaling)."""

from __future__ import annotations

import torch
from torch import nn

from quire.layers.activations import gated_activation
from quire.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from quire.layers.norms import GemmaRMSNorm
from quire.models.config import rope_of
from quire.models.decoder import GLOBAL_ROPE, CausalLM
from quire.models.rope import RotaryEmbedding
from quire.native.fused_ops import rope

LOCAL_ROPE = "sliding_attention"


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, backend, quant_config, prefix: str, qk_norm: bool,
                 rope_kind: str) -> None:
        super().__init__()
        self.backend, self.rope_kind = backend, rope_kind
        h, d, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.qkv_proj = QKVParallelLinear(h, d, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias,
                                          quant_config, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, cfg.o_bias, quant_config,
                                        f"{prefix}.o_proj")
        self.gate_up_proj = MergedColumnParallelLinear(
            h, [cfg.intermediate_size] * 2, False, quant_config, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, h, False, quant_config,
                                           f"{prefix}.down_proj")
        self.act = gated_activation(cfg.hf.hidden_activation)
        self.q_norm = GemmaRMSNorm(d, eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(d, eps) if qk_norm else None
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.k_scale = self.v_scale = 1.0  # fp8 KV cache: stored = value / scale

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        """Keeps its own residual stream: returns (the layer's output, None)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(self.input_layernorm(x)).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = self.backend.forward(q, k, v.reshape(t, self.num_kv_heads, self.head_dim),
                                 k_cache, v_cache, meta, self.k_scale, self.v_scale)
        x = x + self.post_attention_layernorm(self.o_proj(o.reshape(t, self.q_size)))
        m = self.down_proj(self.act(self.gate_up_proj(self.pre_feedforward_layernorm(x))))
        return x + self.post_feedforward_layernorm(m), None


class Gemma2ForCausalLM(CausalLM):
    keeps_own_residual = True  # its layers return residual None

    qk_norm = False
    _LAYER_NORMS = {n: n for n in ("input_layernorm", "post_attention_layernorm",
                                   "pre_feedforward_layernorm", "post_feedforward_layernorm")}

    def __init__(self, cfg, backend_factory, max_model_len, dtype, device,
                 quant_config=None) -> None:
        super().__init__(cfg, backend_factory, max_model_len, dtype, device, quant_config)
        # transformers keeps sqrt(hidden) as a float32 tensor cast to the weights' dtype (in
        # bfloat16 the scale itself is rounded); made once, not per step (CUDA graphs too)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype=dtype, device=device)

    def make_layer(self, index, quant_config):
        cfg, hf = self.cfg, self.cfg.hf
        window = cfg.sliding_windows[index]
        backend = self.backend(window, scale=hf.query_pre_attn_scalar ** -0.5,
                               logit_softcap=getattr(hf, "attn_logit_softcapping", None))
        kind = LOCAL_ROPE if window is not None and self.local_rope() else GLOBAL_ROPE
        return GemmaDecoderLayer(cfg, backend, quant_config, f"layers.{index}", self.qk_norm,
                                 kind)

    def local_rope(self) -> bool:
        return False

    def make_norm(self, size):
        return GemmaRMSNorm(size, self.cfg.rms_norm_eps)

    def embed(self, input_ids):
        return self.embed_tokens(input_ids) * self.embed_scale

    def scale_logits(self, logits):
        cap = getattr(self.cfg.hf, "final_logit_softcapping", None)
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    _LAYER_NORMS = {**Gemma2ForCausalLM._LAYER_NORMS,
                    "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}

    def local_rope(self) -> bool:
        return True

    def make_ropes(self, max_model_len, dtype, device):
        cfg = self.cfg
        ropes = {}
        for kind, layer_type in ((GLOBAL_ROPE, "full_attention"), (LOCAL_ROPE, LOCAL_ROPE)):
            theta, scaling = rope_of(cfg.hf, layer_type)
            ropes[kind] = RotaryEmbedding(cfg.head_dim, theta, scaling,
                                          cfg.max_position_embeddings, max_model_len, dtype,
                                          device, hf_config=cfg.hf, layer_type=layer_type)
        return ropes
