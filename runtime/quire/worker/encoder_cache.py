"""The encoder cache: an image's embeddings by its content hash, so that a second request
with the same image (or a recomputed, preempted one) skips the vision encoder.

Public interface:
    EncoderCache(max_bytes)
    get(hash) -> tensor | None     counts a hit or a miss
    put(hash, tensor)              evicts least recently used entries past max_bytes
    hits, misses, num_bytes, len()

An entry larger than the whole budget is not kept (the step that made it still uses it).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

DEFAULT_MAX_BYTES = 256 * 2**20


class EncoderCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = value
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
