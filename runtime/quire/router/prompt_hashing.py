"""A request body -> its prompt's token ids -> the KV-block hashes the engine will give them.

The hash is the engine's own (`quire.engine.block_pool.hash_block_tokens`, chained, over full
blocks of `block_size` tokens), so the router's notion of "this replica holds this prefix"
is block for block the engine's prefix cache. Chat requests go through the tokenizer's chat
template as the server does. Only the router compares these hashes with each other, so they
need not equal the replica's own values (on Python < 3.12 hash(None) differs per process).

The chain is salted with the request's `model`, as the engine salts it with the LoRA adapter:
a prompt for adapter `sql` never shares KV blocks with the same prompt for the base model or
another adapter, so the router must not count it as a prefix hit either.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from quire.engine.block_pool import hash_block_tokens

logger = logging.getLogger(__name__)


def block_hashes(token_ids: list[int], block_size: int, salt: Any = None) -> list[int]:
    """One chained hash per *full* block, the way KVCacheManager hashes a prompt (`salt` seeds
    the chain, as an adapter does in the engine)."""
    hashes: list[int] = []
    parent = salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


def load_tokenizer(model: str | None, tokenizer: str | None = None):
    """The model's tokenizer, without loading weights: a GGUF file or a folder through the
    runtime's loader, a Hub id through transformers (which fetches only tokenizer files)."""
    from transformers import AutoTokenizer

    from quire.models.loader import load_tokenizer as runtime_load_tokenizer
    from quire.models.loader import resolve_model
    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    if model is None or os.path.exists(model):
        return runtime_load_tokenizer(resolve_model(model), None)
    return AutoTokenizer.from_pretrained(model)


def _template_message(message: Any) -> dict:
    """The message as the server hands it to the chat template (text parts joined)."""
    if not isinstance(message, dict):
        raise ValueError("a message must be an object")
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(p.get("text") or "" for p in content if isinstance(p, dict))
    out = {"role": message.get("role"), "content": content if content is not None else ""}
    if message.get("name") is not None:
        out["name"] = message["name"]
    return out


class PromptHasher:
    def __init__(self, tokenizer, block_size: int) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.tokenizer = tokenizer
        self.block_size = block_size

    def prompt_tokens(self, path: str, body: Any) -> list[int] | None:
        """The prompt's token ids, or None when the body names no prompt we can read (the
        replica will answer it with its own error)."""
        if not isinstance(body, dict):
            return None
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            ids = self.tokenizer.apply_chat_template(
                [_template_message(m) for m in messages],
                add_generation_prompt=body.get("add_generation_prompt", True), tokenize=True,
                chat_template=body.get("chat_template"), return_dict=False)
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: route by the first
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def hashes(self, path: str, body: Any) -> list[int]:
        try:
            tokens = self.prompt_tokens(path, body)
        except Exception as e:  # noqa: BLE001 - a bad body is the replica's to reject
            logger.debug("cannot tokenize the prompt for routing: %s", e)
            return []
        if not tokens:
            return []
        model = body.get("model") if isinstance(body, dict) else None
        return block_hashes(tokens, self.block_size, ("model", model) if isinstance(model, str) else None)
