"""The model registry: config.json's `architectures` entry -> the module that implements it.

Adding a family is one module under quire/models, one line here and one parity test. Each
entry also names the transformers config class that reads the family's config.json (the one
class, not AutoConfig's registry of hundreds) and its `model_type`, which identifies a config
that lists no architecture (a GGUF's, say).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str      # config.json's model_type
    config_class: str    # transformers' config class for it
    module: str          # quire.models.<module>
    class_name: str      # the model class in that module


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", "LlamaConfig", "llama", "LlamaForCausalLM"),
    "MistralForCausalLM": Family("mistral", "MistralConfig", "llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": Family("qwen2", "Qwen2Config", "llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": Family("qwen3", "Qwen3Config", "qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": Family("gemma2", "Gemma2Config", "gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": Family("gemma3_text", "Gemma3TextConfig", "gemma",
                                "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": Family("phi3", "Phi3Config", "phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": Family("olmo2", "Olmo2Config", "olmo2", "Olmo2ForCausalLM"),
    "GraniteForCausalLM": Family("granite", "GraniteConfig", "granite", "GraniteForCausalLM"),
    "MixtralForCausalLM": Family("mixtral", "MixtralConfig", "mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", "Qwen3MoeConfig", "qwen3_moe",
                                  "Qwen3MoeForCausalLM"),
    "GptOssForCausalLM": Family("gpt_oss", "GptOssConfig", "gpt_oss", "GptOssForCausalLM"),
    # vision-language: a vision encoder and projector before a family's decoder
    "LlavaForConditionalGeneration": Family("llava", "LlavaConfig", "llava",
                                            "LlavaForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": Family("gemma3", "Gemma3Config", "gemma3_mm",
                                             "Gemma3ForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": Family("qwen2_5_vl", "Qwen2_5_VLConfig", "qwen2_5_vl",
                                                 "Qwen2_5_VLForConditionalGeneration"),
    # base models without an LM head (sentence-transformers' embedding checkpoints, such as
    # Qwen3-Embedding): the same families, served by the pooling runner
    "LlamaModel": Family("llama", "LlamaConfig", "llama", "LlamaForCausalLM"),
    "MistralModel": Family("mistral", "MistralConfig", "llama", "LlamaForCausalLM"),
    "Qwen2Model": Family("qwen2", "Qwen2Config", "llama", "LlamaForCausalLM"),
    "Qwen3Model": Family("qwen3", "Qwen3Config", "qwen3", "Qwen3ForCausalLM"),
}
_BY_MODEL_TYPE = {f.model_type: arch for arch, f in reversed(ARCHITECTURES.items())}


def resolve_architecture(architectures: list[str] | None, model_type: str | None) -> str:
    """The supported architecture a config names (its `architectures` list first, then its
    model_type), or a one-line error naming it and listing what is supported."""
    archs = list(architectures or [])
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None and not archs:
        arch = _BY_MODEL_TYPE.get(model_type)
    if arch is None:
        named = ", ".join(archs) or model_type or "unknown"
        raise ValueError(f"model architecture {named!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return arch


def family(architecture: str) -> Family:
    return ARCHITECTURES[architecture]


def model_class(architecture: str) -> type:
    f = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"quire.models.{f.module}"), f.class_name)


def config_class(model_type: str):
    """transformers' config class for a model_type we support, or None."""
    arch = _BY_MODEL_TYPE.get(model_type)
    if arch is None:
        return None
    import transformers
    return getattr(transformers, ARCHITECTURES[arch].config_class)
