"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) in plain torch over a flat token batch.

RMSNorm, RoPE, GQA and SwiGLU follow transformers' operation order so that float32 greedy
output matches it token for token. Q/K/V and gate/up are fused into one matmul each (bit-
identical to separate ones in float32, and fewer, larger matmuls are faster).

This file only says which kind of linear each projection is (`quire.layers`); the layers own
the weight format, the tensor-parallel shard and the loading. Under tensor parallelism each
rank holds its attention heads (and the KV heads they read), its slice of the MLP's
intermediate size and of the vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from quire.attention.base import AttentionBackend, AttentionMetadata
from quire.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from quire.layers.norms import RMSNorm
from quire.layers.quantization import QuantConfig
from quire.models.config import ModelConfig
from quire.models.decoder import GLOBAL_ROPE, CausalLM
from quire.native.fused_ops import rope


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend,
                 quant_config: QuantConfig | None, prefix: str) -> None:
        super().__init__()
        self.backend = backend
        h, d = cfg.hidden_size, cfg.head_dim
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = QKVParallelLinear(h, d, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, quant_config, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, cfg.o_bias, quant_config,
                                        f"{prefix}.o_proj")
        self.gate_up_proj = MergedColumnParallelLinear(
            h, [cfg.intermediate_size] * 2, cfg.mlp_bias, quant_config, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(cfg.intermediate_size, h, cfg.mlp_bias, quant_config,
                                           f"{prefix}.down_proj")
        # this rank's heads
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.k_scale = 1.0  # fp8 KV cache: stored = value / scale
        self.v_scale = 1.0

    rope_kind = GLOBAL_ROPE

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        """q [T, H, D], k [T, Hkv, D] before rope: Llama has no q/k norm (Qwen3 does)."""
        return q, k

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        """x: the previous layer's MLP output (the embeddings, with residual None, for the
        first layer); residual: the running sum before it, updated in place. Returns this
        layer's MLP output and the residual: their sum is the layer's output, as in
        transformers (the adds are fused into the norms that follow them)."""
        t = x.shape[0]
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        o = self._attention(h, t, cos, sin, k_cache, v_cache, meta)
        h = self.post_attention_layernorm(o, residual)
        return self._mlp(h), residual

    def _attention(self, h, t, cos, sin, k_cache, v_cache, meta):
        """o_proj(attention(h)): q/k/v, their norms, rope, the paged attention."""
        qkv = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_norm(q.view(t, self.num_heads, self.head_dim),
                            k.view(t, self.num_kv_heads, self.head_dim))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = self.backend.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim),
                                 k_cache, v_cache, meta, self.k_scale, self.v_scale)
        return self.o_proj(o.reshape(t, self.q_size))

    def _mlp(self, h):
        return self.down_proj(self.gate_up_proj.silu_and_mul(h))


class LlamaForCausalLM(CausalLM):
    """Llama, Mistral, Qwen2 and SmolLM2: the shared body with Llama's decoder layer."""

    def make_layer(self, index, quant_config):
        cfg = self.cfg
        return DecoderLayer(cfg, self.backend(cfg.sliding_windows[index]), quant_config,
                            f"layers.{index}")
