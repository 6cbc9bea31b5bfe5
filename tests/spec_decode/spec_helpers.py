"""Shared pieces of the speculative-decoding tests: tiny target and draft models (the draft
a different random model with the target's vocabulary, so its proposals are mostly wrong),
prompts that repeat themselves (so n-gram proposals are often right), and engines."""

from __future__ import annotations

import torch

from quire import LLM
from quire.worker.kv_cache import bytes_per_block

from runtime_helpers import random_prompts, save_tiny_model, smollm2_tokenizer, tiny_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
BLOCK_SIZE = 16


def make_models(root) -> dict[str, str]:
    tokenizer = smollm2_tokenizer()
    return {"target": save_tiny_model(str(root / "target"), tiny_config("llama"), tokenizer),
            "draft": save_tiny_model(str(root / "draft"), tiny_config("llama", num_hidden_layers=1),
                                     tokenizer, seed=1)}


def copy_heavy_prompts() -> list[list[int]]:
    """Random prompts, and the same ones said twice (what the model then says, it has seen)."""
    prompts = random_prompts()
    return prompts + [p + p for p in prompts[:6]]


def engine(path: str, blocks: int | None = None, **kw) -> LLM:
    if blocks is not None:  # a small KV cache: preemption
        kw["kv_cache_memory"] = blocks * bytes_per_block(3, BLOCK_SIZE, 2, 16, torch.float32)
    return LLM(path, dtype="float32", **kw)


def spec_configs(models: dict[str, str]) -> dict[str, dict]:
    return {"ngram": NGRAM,
            "draft": {"model": models["draft"], "num_speculative_tokens": 3},
            # the target as its own draft: every proposal right, the whole k verified each step
            "self-draft": {"model": models["target"], "num_speculative_tokens": 3}}
