"""The one interface every tier keeps, and its counters.

A tier maps a block's SHA-256 chain hash (engine/block_hash.py: it names the block's tokens
and everything before them, adapter and cache_salt included) to the block's K/V bytes, for one
fingerprint (fingerprint.py): what decides those bytes besides the tokens.

    get_many(hashes) -> [payload | None]   one round trip where the tier has trips
    put(hash, payload) -> bool             False: not stored (too big, or the tier is down)
    contains(hash) -> bool                 cheap, for the host tier's dedupe; others may say False
    close()

`shared` tiers outlive the process (disk, remote): only blocks whose hash means the same in
every process go there (not a LoRA block: its chain is seeded with an engine-local key).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

COUNTERS = ("hits", "misses", "stores", "evictions", "errors", "bytes_stored", "bytes_loaded",
            "load_seconds", "num_loads")


@dataclass
class TierStats:
    """Cumulative counters of one tier (exported as quire:kv_offload_* with a tier label)."""
    hits: int = 0            # blocks found by a lookup
    misses: int = 0          # blocks asked for and not found (the first miss ends a lookup)
    stores: int = 0          # blocks written
    evictions: int = 0       # blocks dropped to stay within the size
    errors: int = 0          # lookups or stores that failed (unreachable server, bad file)
    bytes_stored: int = 0    # payload bytes written
    bytes_loaded: int = 0    # payload bytes read back on hits
    load_seconds: float = 0.0  # time spent in lookups that read payloads
    num_loads: int = 0       # such lookups
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def counts(self) -> dict[str, float]:
        with self.lock:
            return {name: getattr(self, name) for name in COUNTERS}

    def add(self, **counts) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)


class KVTier:
    """Base class: subclasses set `name`, `medium`, `shared` and implement the four methods."""
    name = "tier"
    medium = "CPU"    # the KV-events medium (vLLM's BlockStored.medium)
    shared = False

    def __init__(self) -> None:
        self.stats = TierStats()
        self.on_evicted = None  # callable(list[bytes]): the events recorder, when on

    def get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        raise NotImplementedError

    def put(self, block_hash: bytes, payload: bytes) -> bool:
        raise NotImplementedError

    def contains(self, block_hash: bytes) -> bool:
        return False

    def close(self) -> None:
        pass

    def _evicted(self, hashes: list[bytes]) -> None:
        self.stats.add(evictions=len(hashes))
        if self.on_evicted is not None and hashes:
            self.on_evicted(hashes, self.medium)
