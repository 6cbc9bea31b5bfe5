"""vLLM's KV-event wire structs (vllm/distributed/kv_events.py): msgpack arrays, each event
tagged with its class name. Block hashes are our 32-byte SHA-256 digests (msgpack bin), which
vLLM's ExternalBlockHash (bytes | int) allows.

`medium` names where the block lives: "GPU" for the engine's block pool (vLLM's name for it,
on a CPU too), "CPU" for the host tier, "DISK" and "REMOTE" for the others.
"""

from __future__ import annotations

from typing import Any

import msgspec

POOL_MEDIUM = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]  # ours are bytes; vLLM's ExternalBlockHash allows ints
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
