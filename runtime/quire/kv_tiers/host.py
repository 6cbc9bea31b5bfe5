"""Host RAM: an LRU of block payloads within a byte budget (--kv-offloading-size)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from quire.kv_tiers.tier import KVTier


class HostTier(KVTier):
    name = "host"
    medium = "CPU"
    shared = False

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()  # the worker stores while the scheduler looks up

    def __len__(self) -> int:
        return len(self._blocks)

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        with self._lock:
            out = []
            for h in hashes:
                payload = self._blocks.get(h)
                if payload is not None:
                    self._blocks.move_to_end(h)
                out.append(payload)
            return out

    def put(self, block_hash: bytes, payload: bytes) -> bool:
        if len(payload) > self.capacity_bytes:
            return False
        evicted = []
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return True
            while self.used_bytes + len(payload) > self.capacity_bytes:
                old, data = self._blocks.popitem(last=False)
                self.used_bytes -= len(data)
                evicted.append(old)
            self._blocks[block_hash] = payload
            self.used_bytes += len(payload)
        self.stats.add(stores=1, bytes_stored=len(payload))
        self._evicted(evicted)
        return True
