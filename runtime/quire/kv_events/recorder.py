"""Collects what the block pool and the tiers report and hands it to the publisher as one
KVEventBatch per flush (each engine step, and after the tiers' writes).

Called from the engine thread (pool) and the tiers' writer thread, hence the lock. Plain
Python: entries are anything with block_hash, parent_hash, token_ids and lora_id
(step_batch.TierStore, or the pool's own records).
"""

from __future__ import annotations

import threading
import time

from quire.kv_events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class KVEventRecorder:
    def __init__(self, publisher, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self._events: list = []
        self._lock = threading.Lock()

    def stored(self, entries: list, medium: str) -> None:
        """Runs of consecutive blocks of one chain become one BlockStored, as vLLM sends."""
        events = []
        for e in entries:
            last = events[-1] if events else None
            if (last is not None and last.block_hashes[-1] == e.parent_hash
                    and last.lora_id == e.lora_id):
                last.block_hashes.append(e.block_hash)
                last.token_ids.extend(e.token_ids)
                continue
            events.append(BlockStored(block_hashes=[e.block_hash], parent_block_hash=e.parent_hash,
                                      token_ids=list(e.token_ids), block_size=self.block_size,
                                      lora_id=e.lora_id, medium=medium))
        with self._lock:
            self._events.extend(events)

    def removed(self, hashes: list[bytes], medium: str) -> None:
        if hashes:
            with self._lock:
                self._events.append(BlockRemoved(block_hashes=list(hashes), medium=medium))

    def cleared(self) -> None:
        with self._lock:
            self._events.append(AllBlocksCleared())

    def flush(self) -> None:
        with self._lock:
            events, self._events = self._events, []
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def close(self) -> None:
        self.flush()
        self.publisher.close()
