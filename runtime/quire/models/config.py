"""ModelConfig: the architecture facts the runtime needs, read from a transformers config.

The fields every family shares are here; a family module reads its own special fields
(soft-capping, multipliers, per-layer rope) from `hf`, the transformers config itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from quire.models.registry import family, resolve_architecture


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: list[int | None]   # per layer; None = full attention
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    model_type: str = "llama"
    hf: object = field(default=None, repr=False)   # the transformers (decoder's) config
    # a vision-language model's whole config (vision_config, image token, ...); hf is then
    # its text_config, which the decoder reads as a text-only family's
    multimodal_hf: object = field(default=None, repr=False)

    @classmethod
    def from_hf(cls, hf) -> ModelConfig:
        arch = resolve_architecture(getattr(hf, "architectures", None),
                                    getattr(hf, "model_type", None))
        model_type = family(arch).model_type
        outer = None
        if getattr(hf, "text_config", None) is not None and \
                getattr(hf, "vision_config", None) is not None:  # the decoder's facts
            outer, hf = hf, hf.get_text_config()
            model_type = hf.model_type
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        theta, scaling = rope_of(hf)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = frozenset(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.max_position_embeddings,
            # a vision-language config says it on the outer config (transformers 5 moves the
            # text config's there)
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)
                                     or getattr(outer, "tie_word_embeddings", False)),
            qkv_bias=model_type in _QWEN2_BIASES or attention_bias,
            o_bias=model_type not in _QWEN2_BIASES and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_windows=_sliding_windows(hf, model_type),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
            model_type=model_type,
            hf=hf,
            multimodal_hf=outer,
        )


# decoders with Qwen2's q/k/v biases (and none on o_proj)
_QWEN2_BIASES = ("qwen2", "qwen2_5_vl_text")


def rope_of(hf, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling parameters or None) of a config's rope, or of one layer type's where
    the config has one per layer type (Gemma 3: `rope_parameters[layer_type]`)."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if layer_type is not None or "full_attention" in rope:
        rope = dict(rope.get(layer_type or "full_attention") or {})
    theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
    if rope.get("rope_type", "default") == "default" and layer_type is None:
        rope = dict(getattr(hf, "rope_scaling", None) or {}) or rope
    kind = rope.get("rope_type", rope.get("type", "default"))
    return float(theta), rope if kind != "default" else None


def _sliding_windows(hf, model_type: str) -> list[int | None]:
    n, window = hf.num_hidden_layers, getattr(hf, "sliding_window", None)
    if not window:
        return [None] * n
    if model_type in ("mistral", "phi3"):  # every layer slides
        return [window] * n
    layer_types = getattr(hf, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [None] * n
