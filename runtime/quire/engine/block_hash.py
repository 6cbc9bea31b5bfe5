"""Prefix-cache block hashes: SHA-256 over a canonical encoding, one function for the engine's
KV-cache manager and the router's prefix-aware routing, so that routing and caching agree.

Public interface:
    ExtraKeys(adapter, cache_salt, long_rope, client_request)   what besides the tokens
                                            decides whether two blocks hold the same K/V
    extend_block_hashes(hashes, token_ids, block_size, num_full_blocks, keys, images)
                                            appends the chained hashes of the next full blocks
    hash_block_tokens(parent, token_ids, extra)   one block's hash from its parent's
    block_image_keys(images, first, end)    the image digests a token range holds
    chain_root(keys)                        the parent of a sequence's first block
    check_cache_salt(salt)                  ValueError naming cache_salt unless it is usable
    MAX_CACHE_SALT_CHARS

A block's hash is SHA-256(parent digest || its token ids as little-endian uint32), and the
first block's parent is SHA-256(domain tag || the extra keys as canonical JSON). Python's
built-in `hash()` of int tuples, used before, can be computed (and collided) offline by
anyone, so one tenant could make another's prompt hit blocks it never wrote (vLLM's advisory
GHSA-rm76-4mrf-v9r8). Every input has one encoding: the parent is always 32 bytes, the tokens
fixed-width, and the extra keys a JSON object with sorted keys, ASCII only, no whitespace,
holding only strings, ints and true (never repr or pickle of arbitrary objects). Keys at
their default are left out, so a key added later leaves today's hashes as they are.

A block that holds any placeholder position of an image also hashes that image's content
digest (32 bytes each, in prompt order, after the tokens): the placeholder tokens are the same
for every image, so without it the same text with another image would hit. The message is
then longer than a text block's (parent + 4 x block_size bytes), so the two never collide; a
text block's hash is as it was (the router's, which sees no images, stays valid).

The full 32-byte digest is kept (as vLLM does): it is the dict key of the block pool, a few
dozen bytes per block, and no argument about truncated collision bounds is needed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from quire.validation import QuireValidationError

MAX_CACHE_SALT_CHARS = 1024
_DOMAIN = b"quire/kv-block-hash/v1\0"
_packers: dict[int, struct.Struct] = {}


@dataclass(frozen=True)
class ExtraKeys:
    """Seeds a sequence's hash chain: blocks under different keys never match.

    adapter: the engine salts with its LoRA registration's key (an int, unique for the
        engine's lifetime); the router with the request's `model` name (a string).
    cache_salt: the client's `cache_salt`: tenants with different salts never share blocks.
    long_rope: the K/V were rotated with LongRoPE's long table (scheduler: the switch).
    client_request: with prefix caching off, only the sequences of this client request share.
    """

    adapter: int | str | None = None
    cache_salt: str | None = None
    long_rope: bool = False
    client_request: str | int | None = None

    def encode(self) -> bytes:
        fields = {k: v for k, v in (("adapter", self.adapter), ("cache_salt", self.cache_salt),
                                    ("client_request", self.client_request))
                  if v is not None}
        for name, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise TypeError(f"ExtraKeys.{name} must be an int or a string, got "
                                f"{type(value).__name__}")
        if self.long_rope:
            fields["long_rope"] = True
        return json.dumps(fields, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True).encode("ascii")


NO_EXTRA_KEYS = ExtraKeys()
_PLAIN_ROOT = hashlib.sha256(_DOMAIN + NO_EXTRA_KEYS.encode()).digest()


def chain_root(keys: ExtraKeys = NO_EXTRA_KEYS) -> bytes:
    """The parent digest of a sequence's first block."""
    if keys == NO_EXTRA_KEYS:
        return _PLAIN_ROOT
    return hashlib.sha256(_DOMAIN + keys.encode()).digest()


def hash_block_tokens(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Chained: a block is identified by its tokens *and* everything before them. Token ids
    must be in [0, 2^32) (struct.error otherwise). `extra`: the digests of the images whose
    placeholders the block holds (block_image_keys)."""
    n = len(token_ids)
    packer = _packers.get(n)
    if packer is None:
        packer = _packers[n] = struct.Struct(f"<{n}I")
    return hashlib.sha256(parent + packer.pack(*token_ids) + extra).digest()


def block_image_keys(images: Sequence, first: int, end: int) -> bytes:
    """The digests (32 bytes each, in order) of the images whose placeholder runs overlap
    token positions [first, end). `images`: objects with `offset`, `length` and `digest`
    (quire.multimodal.inputs.ImageSpan)."""
    return b"".join(im.digest for im in images
                    if im.offset < end and im.offset + im.length > first)


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        num_full_blocks: int, keys: ExtraKeys = NO_EXTRA_KEYS,
                        images: Sequence = ()) -> None:
    """Append to `hashes` (the chain so far) until it covers `num_full_blocks` blocks. Each
    block is hashed once, when it is first asked for (a block fills), never per step.
    `images`: the prompt's image placeholder runs (ImageSpan), hashed into their blocks."""
    parent = hashes[-1] if hashes else chain_root(keys)
    for i in range(len(hashes), num_full_blocks):
        first, end = i * block_size, (i + 1) * block_size
        extra = block_image_keys(images, first, end) if images else b""
        parent = hash_block_tokens(parent, token_ids[first:end], extra)
        hashes.append(parent)


def check_cache_salt(salt: object) -> None:
    """A cache_salt is None or a non-empty string of at most MAX_CACHE_SALT_CHARS."""
    if salt is None:
        return
    if not isinstance(salt, str):
        raise QuireValidationError(
            "cache_salt", f"cache_salt must be a string, got {type(salt).__name__}", salt)
    if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise QuireValidationError(
            "cache_salt", f"cache_salt must be a non-empty string of at most "
            f"{MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")

