"""A request body -> its prompt's token ids -> the KV-block hashes the engine will give them.

The hash is the engine's own (`quire.engine.block_hash.extend_block_hashes`: SHA-256, chained,
over full blocks of `block_size` tokens), so the router's notion of "this replica holds this
prefix" is block for block the engine's prefix cache. Chat requests go through the tokenizer's
chat template as the server does.

The chain is seeded with the request's `model` (as the engine seeds it with the LoRA adapter)
and its `cache_salt` (as the engine does): a prompt for adapter `sql`, or under another
tenant's salt, never shares KV blocks with the same prompt otherwise, so the router must not
count it as a prefix hit either. Only the router compares these hashes with each other, so
naming an adapter by its `model` rather than the engine's registration key is fine; a request
with neither `model` nor adapter gets exactly the replica's own hashes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from quire.engine.block_hash import NO_EXTRA_KEYS, ExtraKeys, extend_block_hashes

logger = logging.getLogger(__name__)


def block_hashes(token_ids: list[int], block_size: int,
                 keys: ExtraKeys = NO_EXTRA_KEYS) -> list[bytes]:
    """One chained hash per *full* block, the way KVCacheManager hashes a prompt (`keys` seed
    the chain, as a sequence's adapter and cache_salt do in the engine)."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, len(token_ids) // block_size, keys)
    return hashes


def request_keys(body: dict, with_model: bool = True) -> ExtraKeys:
    """The extra keys a request body names: its `model` and its `cache_salt` (strings only:
    anything else is the replica's to refuse). `with_model` False: the engine's own keys for
    the base model (precise-prefix routing compares with the replicas' real block hashes, and
    an adapter's engine key is the replica's own: its requests simply never match)."""
    model, salt = body.get("model"), body.get("cache_salt")
    return ExtraKeys(adapter=model if with_model and isinstance(model, str) else None,
                     cache_salt=salt if isinstance(salt, str) and salt else None)


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
    def __init__(self, tokenizer, block_size: int, seed_with_model: bool = True) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.seed_with_model = seed_with_model

    def prompt_tokens(self, path: str, body: Any) -> list[int] | None:
        """The prompt's token ids, or None when the body names no prompt we can read (the
        replica will answer it with its own error)."""
        if not isinstance(body, dict):
            return None
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            if body.get("chat_template") is not None:
                # a client's own template is a program: the replica runs it in its sandbox,
                # within a time and size budget (or refuses it); the router, unbounded, would
                # let one request tie up routing for everyone. Such a request is not hashed.
                return None
            ids = self.tokenizer.apply_chat_template(
                [_template_message(m) for m in messages],
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False) is True,
                tokenize=True, return_dict=False)
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: route by the first
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def hashes(self, path: str, body: Any) -> list[bytes]:
        try:
            tokens = self.prompt_tokens(path, body)
            if not tokens:
                return []
            return block_hashes(tokens, self.block_size,
                                request_keys(body, self.seed_with_model))
        except Exception as e:  # noqa: BLE001 - a bad body is the replica's to reject
            logger.debug("cannot hash the prompt for routing: %s", e)
            return []
