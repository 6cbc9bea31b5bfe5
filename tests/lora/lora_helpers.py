"""Helpers for the LoRA tests: a tiny random Llama, random PEFT adapters written by `peft`
itself, and transformers + PEFT (merged) as the greedy reference."""

from __future__ import annotations

import json
import os

import torch

from runtime_helpers import (
    hf_greedy,
    hf_model,
    random_prompts,
    save_tiny_model,
    smollm2_tokenizer,
    tiny_config,
)

MAX_NEW_TOKENS = 16

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

__all__ = ["hf_greedy", "hf_model", "random_prompts", "save_tiny_model", "smollm2_tokenizer",
           "tiny_config", "save_random_adapter", "merged_reference_model", "ALL_TARGETS"]


def save_random_adapter(base_path: str, out_path: str, r: int = 8, lora_alpha: float = 16,
                        targets=ALL_TARGETS, seed: int = 0, std: float = 0.1,
                        **config) -> str:
    """A PEFT LoRA adapter on the model at base_path with random A *and* B (PEFT starts B at
    zero, which would make the adapter a no-op)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = get_peft_model(hf_model(base_path), LoraConfig(
        r=r, lora_alpha=lora_alpha, target_modules=list(targets), lora_dropout=0.0,
        **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0, std)
    model.save_pretrained(out_path)
    return out_path


def merged_reference_model(base_path: str, adapter_path: str):
    """transformers + PEFT with the adapter merged into the weights (merge_and_unload)."""
    from peft import PeftModel
    return PeftModel.from_pretrained(hf_model(base_path), adapter_path).merge_and_unload().eval()


def edit_adapter_config(path: str, **changes) -> None:
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)
