"""The body every decoder-only family shares: embeddings, a stack of decoder layers, the final
norm and LM head, rotary tables, attention backends and checkpoint loading.

A family module subclasses `CausalLM` and says only what differs: its decoder layer
(`make_layer`), its norm, its embedding and logit scaling, its rotary tables per layer kind,
and how its checkpoint names map onto ours (`_FUSED`, `_PLAIN`, `_LAYER_NORMS`).

Layers follow one protocol: `layer(x, residual, cos, sin, k_cache, v_cache, meta)` returns
(x, residual) whose sum is the layer's output; a layer that keeps its own residual stream
(sandwich norms) returns residual None. Each layer names the rotary table it reads
(`rope_kind`) and gets one backend per distinct attention option set (window, soft-cap,
scale): `CausalLM.backend(...)`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from quire import parallel_state as ps
from quire.attention.base import AttentionMetadata
from quire.layers.linear import LinearBase
from quire.layers.quantization import QuantConfig
from quire.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from quire.layers.weights import materialize, narrow, shape_of
from quire.models.config import ModelConfig
from quire.models.rope import RotaryEmbedding

GLOBAL_ROPE = "global"


class MissingLayer(nn.Module):
    """Another pipeline stage's layer: holds nothing (its weights are skipped at load)."""


class CausalLM(nn.Module):
    # a layer that keeps its own residual stream returns residual None (sandwich norms): what
    # a pipeline stage sends on is then x alone
    keeps_own_residual = False

    # transformers module -> (our fused layer, the part's shard id)
    _FUSED = {
        "self_attn.q_proj": ("qkv_proj", "q"), "self_attn.k_proj": ("qkv_proj", "k"),
        "self_attn.v_proj": ("qkv_proj", "v"), "mlp.gate_proj": ("gate_up_proj", 0),
        "mlp.up_proj": ("gate_up_proj", 1),
    }
    _PLAIN = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj"}
    # per-layer norms: transformers module -> ours (the same name unless said otherwise)
    _LAYER_NORMS = {"input_layernorm": "input_layernorm",
                    "post_attention_layernorm": "post_attention_layernorm"}
    # checkpoint tensors that hold several of our parts (Phi-3's fused qkv and gate_up):
    # transformers module -> [(its first row, rows, the transformers module it stands for)]
    # computed per model by `_split_parts`; empty for families whose checkpoints are unfused
    _TOP = {"embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "lm_head.weight",
            "norm.weight": "norm.weight"}

    def __init__(self, cfg: ModelConfig, backend_factory, max_model_len: int,
                 dtype: torch.dtype, device: torch.device,
                 quant_config: QuantConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self._backend_factory = backend_factory
        self.backends: dict = {}  # one per distinct attention option set
        # a pipeline stage holds its layers; the embedding lives on the first stage (and the
        # last, when the LM head is tied to it), the final norm and LM head on the last
        self.stage = stage = ps.pipeline_stage()
        self.stage_layers = range(stage.first_layer, min(stage.end_layer, cfg.num_layers))
        tied = cfg.tie_word_embeddings
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                    quant_config)
                             if stage.is_first or (stage.is_last and tied) else None)
        self.layers = nn.ModuleList(self.make_layer(i, quant_config) if stage.owns(i)
                                    else MissingLayer() for i in range(cfg.num_layers))
        self.norm = self.lm_head = None
        if stage.is_last:
            self.norm = self.make_norm(cfg.hidden_size)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config)
            if tied:
                self.lm_head.tie_to(self.embed_tokens)
        # what the KV cache holds (per layer of this stage)
        self.num_kv_heads_per_rank = self.layers[self.stage_layers[0]].num_kv_heads
        self.ropes = self.make_ropes(max_model_len, dtype, device)
        self.rope = self.ropes[GLOBAL_ROPE]  # what the runner asks about (type, table size)

    # --- what a family says ----------------------------------------------------------------
    def make_layer(self, index: int, quant_config: QuantConfig | None) -> nn.Module:
        raise NotImplementedError

    def make_norm(self, size: int) -> nn.Module:
        from quire.layers.norms import RMSNorm
        return RMSNorm(size, self.cfg.rms_norm_eps)

    def make_ropes(self, max_model_len: int, dtype, device) -> dict[str, RotaryEmbedding]:
        cfg = self.cfg
        return {GLOBAL_ROPE: RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
            max_model_len, dtype, device, hf_config=cfg.hf)}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    # --- shared ------------------------------------------------------------------------------
    def backend(self, window: int | None, **options):
        """The attention backend for one option set (sliding window, logit_softcap, scale),
        shared by every layer that has the same."""
        key = (window, *sorted(options.items()))
        if key not in self.backends:
            self.backends[key] = self._backend_factory(window, **options)
        return self.backends[key]

    def prepare(self, meta: AttentionMetadata) -> None:
        for backend in self.backends.values():
            backend.prepare(meta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                rope_seq_lens: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None):
        """The final hidden states; on a pipeline stage before the last, (x, residual) for
        the next stage (`forward_stage`). `inputs_embeds`: the embeddings to start from in
        place of the tokens' (a multimodal prompt's, with its images merged in)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        x, residual = self.forward_stage(x, None, positions, meta, kv_caches, rope_seq_lens)
        if not self.stage.is_last:
            return x, residual
        return x if residual is None else residual + x

    def forward_stage(self, x: torch.Tensor, residual: torch.Tensor | None,
                      positions: torch.Tensor, meta: AttentionMetadata,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      rope_seq_lens: torch.Tensor | None = None):
        """This stage's layers (kv_caches: one per stage layer) from the previous stage's
        (x, residual), or from the embeddings with residual None."""
        tables = {kind: rope.cos_sin(positions, rope_seq_lens)
                  for kind, rope in self.ropes.items()}
        for i, (k_cache, v_cache) in zip(self.stage_layers, kv_caches):
            layer = self.layers[i]
            cos, sin = tables[layer.rope_kind]
            x, residual = layer(x, residual, cos, sin, k_cache, v_cache, meta)
        return x, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Final norm and LM head for the rows that sample, in the model dtype (the sampler
        widens them to float32 when it needs more than an argmax). Under tensor parallelism
        only rank 0 gets the logits (the others get None)."""
        logits = self.lm_head(self.norm(hidden))
        return None if logits is None else self.scale_logits(logits)

    def pack_weights(self) -> None:
        """Called once the weights are loaded: each linear layer's quant method turns the
        loaded weights into its kernel's format (oneDNN-packed bf16 on CPU, for now)."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    # --- weights -------------------------------------------------------------------------
    def _split_parts(self, module: str) -> list[tuple[int, int, str]] | None:
        """A checkpoint module that fuses several of transformers' usual ones: its parts as
        (first row, rows, the usual module name). None: not fused."""
        return None

    def _load_special(self, name: str, tensor) -> bool:
        """A family's own loading for tensors the shared rules don't cover (a MoE's experts):
        True if it took the tensor. Their parameters are `_loads_itself`."""
        return False

    @staticmethod
    def _loads_itself(param) -> bool:
        """Parameters filled by `_load_special`: the shared loader neither fills nor checks
        them (their owner says what it lacks)."""
        return hasattr(param, "moe_proj") or getattr(param, "loads_itself", False)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        """Takes (transformers name, tensor or lazy safetensors slice) pairs; each parameter's
        layer keeps its shard of it. Fills every parameter or says what lacks."""
        params = {n: p for n, p in self.named_parameters() if not self._loads_itself(p)}
        wanted = set(params)
        parts_seen: dict[str, set] = {}
        filled: set[str] = set()
        fused_parts = {}  # our fused parameter -> the shard ids it takes
        for ours in params:
            if ours.startswith("layers."):
                shard_ids = {s for f, s in self._FUSED.values() if f == ours.split(".")[2]}
                if shard_ids:
                    fused_parts[ours] = shard_ids

        def complete(ours: str) -> bool:
            return ours in filled or (ours in fused_parts
                                      and parts_seen.get(ours) == fused_parts[ours])

        for name, tensor in self._unfuse(weights):
            if self._load_special(name, tensor):
                continue
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
            want = fused_parts.get(ours, set())
            if parts != want:
                raise ValueError(f"the checkpoint has only {len(parts)} of the {len(want)} "
                                 f"parts fused into {ours}")
            filled.add(ours)
        missing = sorted(wanted - filled)
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(f"the checkpoint lacks {len(missing)} weights the model needs: {shown}")

    def _unfuse(self, weights: Iterable[tuple[str, object]]):
        """Splits checkpoint tensors that fuse several usual modules into those modules (lazy
        slices stay lazy: each part reads only its rows)."""
        for name, tensor in weights:
            module, _, kind = name.rpartition(".")
            head, sep, rest = module.partition("layers.")
            layer_module = rest.partition(".")[2] if sep and rest[:1].isdigit() else ""
            split = self._split_parts(layer_module) if kind in ("weight", "bias") else None
            if not split:
                yield name, tensor
                continue
            prefix = module[: len(module) - len(layer_module)]
            for first, rows, usual in split:
                yield f"{prefix}{usual}.{kind}", narrow(tensor, 0, first, rows)

    def _our_name(self, name: str) -> tuple[str, object] | None:
        name = name.removeprefix("model.")
        if name in self._TOP or name.startswith(("embed_tokens.", "lm_head.")):
            return self._TOP.get(name, name), None  # a quantized table: qweight, scales
        if not name.startswith("layers."):
            return None
        _, idx, rest = name.split(".", 2)
        part, kind = rest.rsplit(".", 1)
        if part in self._LAYER_NORMS:
            return f"layers.{idx}.{self._LAYER_NORMS[part]}.{kind}", None
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
