"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) in plain torch over a flat token batch.

RMSNorm, RoPE, GQA and SwiGLU follow transformers' operation order so that float32 greedy
output matches it token for token. Q/K/V and gate/up are fused into one matmul each (bit-
identical to separate ones in float32, and fewer, larger matmuls are faster).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from quire.attention.base import AttentionBackend, AttentionMetadata
from quire.models import packed_linear
from quire.models.config import ModelConfig
from quire.models.rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, h)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.o_proj = _param(h, self.q_size)
        self.o_bias = _param(h) if cfg.o_bias else None
        self.gate_up_proj = _param(2 * cfg.intermediate_size, h)
        self.gate_up_bias = _param(2 * cfg.intermediate_size) if cfg.mlp_bias else None
        self.down_proj = _param(h, cfg.intermediate_size)
        self.down_bias = _param(h) if cfg.mlp_bias else None
        self.k_scale = 1.0  # fp8 KV cache: stored = value / scale
        self.v_scale = 1.0
        self.packed: dict[str, torch.Tensor] = {}  # see pack_weights()

    _PROJECTIONS = ("qkv", "o", "gate_up", "down")

    def pack_weights(self) -> None:
        """Packs the projections for oneDNN where that pays (bf16 on CPU) and frees the
        plain copies, so the model holds its weights once."""
        for name in self._PROJECTIONS:
            weight = getattr(self, f"{name}_proj")
            packed = packed_linear.pack(weight)
            if packed is None:
                return
            self.packed[name] = packed
            weight.data = weight.data.new_empty(0)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = getattr(self, f"{name}_bias")
        packed = self.packed.get(name)
        if packed is not None:
            return packed_linear.linear(x, packed, bias)
        return F.linear(x, getattr(self, f"{name}_proj"), bias)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        t = x.shape[0]
        residual = x
        x = self.input_layernorm(x)
        qkv = self._linear(x, "qkv")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = apply_rope(q.view(t, self.num_heads, self.head_dim),
                          k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        o = self.backend.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim),
                                 k_cache, v_cache, meta, self.k_scale, self.v_scale)
        x = residual + self._linear(o.reshape(t, self.q_size), "o")
        residual = x
        x = self.post_attention_layernorm(x)
        gate, up = self._linear(x, "gate_up").chunk(2, dim=-1)
        return residual + self._linear(F.silu(gate) * up, "down")


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_factory, max_model_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        # one backend per distinct sliding window (usually one for all layers)
        self.backends = {w: backend_factory(w) for w in dict.fromkeys(cfg.sliding_windows)}
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.backends[w]) for w in cfg.sliding_windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.packed_lm_head: torch.Tensor | None = None
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                    cfg.max_position_embeddings, max_model_len, dtype, device)

    def prepare(self, meta: AttentionMetadata) -> None:
        for backend in self.backends.values():
            backend.prepare(meta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                rope_seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope.cos_sin(positions, rope_seq_lens)
        x = F.embedding(input_ids, self.embed_tokens)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for the rows that sample, in the model dtype (the sampler
        widens them to float32 when it needs more than an argmax)."""
        if self.packed_lm_head is not None:
            return packed_linear.linear(self.norm(hidden), self.packed_lm_head, None)
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(self.norm(hidden), weight)

    def pack_weights(self) -> None:
        """Called once the weights are loaded: oneDNN-packed projections where that pays.
        A tied LM head keeps the embedding table too (lookups need it)."""
        for layer in self.layers:
            layer.pack_weights()
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        self.packed_lm_head = packed_linear.pack(weight)
        if self.packed_lm_head is not None and self.lm_head is not None:
            self.lm_head.data = self.lm_head.data.new_empty(0)

    # --- weights -------------------------------------------------------------------------
    _FUSED = {  # transformers module -> (our fused parameter, its slot in the fused tensor)
        "self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1),
        "self_attn.v_proj": ("qkv", 2), "mlp.gate_proj": ("gate_up", 0),
        "mlp.up_proj": ("gate_up", 1),
    }
    _PLAIN = {"self_attn.o_proj": "o", "mlp.down_proj": "down"}
    _TOP = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head",
            "norm.weight": "norm.weight"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes (transformers name, tensor) pairs; fills every parameter or says what lacks."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[int, torch.Tensor]] = {}
        filled: set[str] = set()
        for name, tensor in weights:
            target = self._our_name(name)
            if target is None or target[0] not in params:
                continue  # rotary buffers, a tied lm_head, ...
            ours, slot = target
            if slot is None:
                self._copy(name, params[ours], tensor)
                filled.add(ours)
            else:
                pending.setdefault(ours, {})[slot] = tensor
        for ours, parts in pending.items():
            want = 3 if ".qkv_" in ours else 2
            if sorted(parts) != list(range(want)):
                raise ValueError(f"the checkpoint has only {len(parts)} of the {want} parts "
                                 f"fused into {ours}")
            self._copy(ours, params[ours], torch.cat([parts[i] for i in range(want)]))
            filled.add(ours)
        missing = sorted(set(params) - filled)
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(f"the checkpoint lacks {len(missing)} weights the model needs: {shown}")

    def _our_name(self, name: str) -> tuple[str, int | None] | None:
        name = name.removeprefix("model.")
        if name in self._TOP:
            return self._TOP[name], None
        if not name.startswith("layers."):
            return None
        _, idx, rest = name.split(".", 2)
        part, kind = rest.rsplit(".", 1)
        suffix = "proj" if kind == "weight" else "bias"
        if part in ("input_layernorm", "post_attention_layernorm"):
            return f"layers.{idx}.{part}.weight", None
        if part in self._FUSED:
            fused, slot = self._FUSED[part]
            return f"layers.{idx}.{fused}_{suffix}", slot
        if part in self._PLAIN:
            return f"layers.{idx}.{self._PLAIN[part]}_{suffix}", None
        return None

    @staticmethod
    def _copy(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, "
                             f"the config implies {tuple(target.shape)}")
        target.data.copy_(tensor)
