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

from collections.abc import Iterable

import torch
from torch import nn

from quire.attention.base import AttentionBackend, AttentionMetadata
from quire.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from quire.layers.quantization import QuantConfig
from quire.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from quire.layers.weights import materialize, shape_of
from quire.models.config import ModelConfig
from quire.models.fused_ops import rms_norm, rope_, silu_and_mul
from quire.models.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' LlamaRMSNorm of x; with a residual, of residual += x (in place)."""
        return rms_norm(x, self.weight, self.eps, residual)


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
        qkv = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = rope_(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = rope_(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        o = self.backend.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim),
                                 k_cache, v_cache, meta, self.k_scale, self.v_scale)
        h = self.post_attention_layernorm(self.o_proj(o.reshape(t, self.q_size)), residual)
        return self.down_proj(silu_and_mul(self.gate_up_proj(h))), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend_factory, max_model_len: int,
                 dtype: torch.dtype, device: torch.device,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        # one backend per distinct sliding window (usually one for all layers)
        self.backends = {w: backend_factory(w) for w in dict.fromkeys(cfg.sliding_windows)}
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, quant_config)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.backends[w], quant_config, f"layers.{i}")
            for i, w in enumerate(cfg.sliding_windows))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config)
        if cfg.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)
        self.num_kv_heads_per_rank = self.layers[0].num_kv_heads  # what the KV cache holds
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                    cfg.max_position_embeddings, max_model_len, dtype, device)

    def prepare(self, meta: AttentionMetadata) -> None:
        for backend in self.backends.values():
            backend.prepare(meta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                rope_seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope.cos_sin(positions, rope_seq_lens)
        x, residual = self.embed_tokens(input_ids), None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, meta)
        return residual + x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Final norm and LM head for the rows that sample, in the model dtype (the sampler
        widens them to float32 when it needs more than an argmax). Under tensor parallelism
        only rank 0 gets the logits (the others get None)."""
        return self.lm_head(self.norm(hidden))

    def pack_weights(self) -> None:
        """Called once the weights are loaded: each linear layer's quant method turns the
        loaded weights into its kernel's format (oneDNN-packed bf16 on CPU, for now)."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    # --- weights -------------------------------------------------------------------------
    _FUSED = {  # transformers module -> (our fused layer, the part's shard id)
        "self_attn.q_proj": ("qkv_proj", "q"), "self_attn.k_proj": ("qkv_proj", "k"),
        "self_attn.v_proj": ("qkv_proj", "v"), "mlp.gate_proj": ("gate_up_proj", 0),
        "mlp.up_proj": ("gate_up_proj", 1),
    }
    _PLAIN = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj"}
    _TOP = {"embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "lm_head.weight",
            "norm.weight": "norm.weight"}

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Takes (transformers name, tensor or lazy safetensors slice) pairs; each parameter's
        layer keeps its shard of it. Fills every parameter or says what lacks."""
        params = dict(self.named_parameters())
        wanted = set(params)
        parts_seen: dict[str, set] = {}
        filled: set[str] = set()

        def parts_wanted(ours: str) -> int:  # checkpoint tensors fused into one of ours
            return 3 if ".qkv_" in ours else 2

        def complete(ours: str) -> bool:
            return ours in filled or len(parts_seen.get(ours, ())) == parts_wanted(ours)

        for name, tensor in weights:
            target = self._our_name(name)
            if target is None or target[0] not in params:
                continue  # rotary buffers, a tied lm_head, ...
            ours, shard_id = target
            param = params[ours]
            module_name = ours.rsplit(".", 1)[0]
            owner = self.get_submodule(module_name)
            loader = getattr(owner, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard_id)
            else:  # norms: replicated
                self._copy(name, param, materialize(tensor))
            if shard_id is None:
                filled.add(ours)
            else:
                parts_seen.setdefault(ours, set()).add(shard_id)
            # a linear (all are the decoder layers') with all its weights in is processed
            # (quantized, packed) now, and its float weight freed: the load never holds the
            # whole float model
            if isinstance(owner, LinearBase):
                own = [f"{module_name}.{n}" for n, _ in owner.named_parameters(recurse=False)]
                if all(complete(n) for n in own):
                    for n in own:  # no reference left here keeps the float weight alive
                        params.pop(n)
                    param = tensor = None
                    owner.process_weights_after_loading()
        for ours, parts in parts_seen.items():
            want = parts_wanted(ours)
            if len(parts) != want:
                raise ValueError(f"the checkpoint has only {len(parts)} of the {want} parts "
                                 f"fused into {ours}")
            filled.add(ours)
        missing = sorted(wanted - filled)
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(f"the checkpoint lacks {len(missing)} weights the model needs: {shown}")

    def _our_name(self, name: str) -> tuple[str, object] | None:
        name = name.removeprefix("model.")
        if name in self._TOP or name.startswith(("embed_tokens.", "lm_head.")):
            return self._TOP.get(name, name), None  # a quantized table: qweight, scales
        if not name.startswith("layers."):
            return None
        _, idx, rest = name.split(".", 2)
        part, kind = rest.rsplit(".", 1)
        if part in ("input_layernorm", "post_attention_layernorm"):
            return f"layers.{idx}.{part}.weight", None
        if part in self._FUSED:
            fused, shard_id = self._FUSED[part]
            return f"layers.{idx}.{fused}.{kind}", shard_id
        if part in self._PLAIN:
            return f"layers.{idx}.{self._PLAIN[part]}.{kind}", None
        return None

    @staticmethod
    def _copy(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
        if tuple(target.shape) != shape_of(tensor):
            raise ValueError(f"weight {name} has shape {shape_of(tensor)}, "
                             f"the config implies {tuple(target.shape)}")
        target.data.copy_(tensor)
