"""ModelConfig: the architecture facts the runtime needs, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass

# architecture name -> (qkv projections carry a bias, the o projection carries a bias)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}


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

    @classmethod
    def from_hf(cls, hf) -> ModelConfig:
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = _MODEL_TYPES.get(getattr(hf, "model_type", None))
        if arch is None:
            named = ", ".join(archs) or getattr(hf, "model_type", "unknown")
            raise ValueError(f"model architecture {named!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
        if rope.get("rope_type", "default") == "default":
            rope = dict(getattr(hf, "rope_scaling", None) or {}) or rope
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
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
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family == "llama" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_windows=_sliding_windows(hf, family),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
        )


def _sliding_windows(hf, family: str) -> list[int | None]:
    n, window = hf.num_hidden_layers, getattr(hf, "sliding_window", None)
    if family == "mistral":
        return [window] * n
    layer_types = getattr(hf, "layer_types", None)
    if family == "qwen2" and window and layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [None] * n
