"""The tier chain: host RAM first, then disk, then the shared server.

    lookup(hashes, shared_ok) -> [payload]   the payloads of the longest run of leading
                                             blocks that some tier holds (each block from the
                                             first tier that has it); disk and remote hits
                                             are promoted into the host tier
    store(entries, payloads)                 every tier takes the block: the host at once,
                                             disk and remote on a writer thread (off the step)
    flush()                                  wait for the writer (tests, shutdown)
    snapshot()                               tier -> lifetime counters, for metrics
    close()
    tiers, stats: one TierStats per tier

`shared_ok`: a sequence whose hash chain means the same in every process (no LoRA adapter,
whose key is engine-local) may use the shared tiers; others use the host tier only. Entries
say the same of each stored block.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from quire.kv_tiers.tier import KVTier

logger = logging.getLogger(__name__)
WRITE_QUEUE_BLOCKS = 4096  # blocks waiting for disk/remote; beyond it new ones are skipped


class TierChain:
    def __init__(self, tiers: list[KVTier], events=None) -> None:
        self.tiers = tiers
        self.events = events  # a KVEventRecorder, or None
        self.host = next((t for t in tiers if t.name == "host"), None)
        self.num_lookups = 0
        self.num_dropped_writes = 0
        for tier in tiers:
            if events is not None:
                tier.on_evicted = events.removed
        self._slow = [t for t in tiers if t.shared]
        self._queue: queue.Queue = queue.Queue(WRITE_QUEUE_BLOCKS)
        self._writer = None
        if self._slow:
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer",
                                            daemon=True)
            self._writer.start()

    @property
    def stats(self) -> dict[str, object]:
        return {t.name: t.stats for t in self.tiers}

    def snapshot(self) -> dict[str, dict[str, float]]:
        """tier -> its lifetime counters (plain numbers, for the metrics endpoint)."""
        return {t.name: t.stats.counts() for t in self.tiers}

    # --- lookups -------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], shared_ok: bool = True) -> list[bytes]:
        if not hashes:
            return []
        self.num_lookups += 1
        found: list[bytes | None] = [None] * len(hashes)
        source: list[KVTier | None] = [None] * len(hashes)
        for tier in self.tiers:
            if tier.shared and not shared_ok:
                continue
            want = [i for i, p in enumerate(found) if p is None]
            t0 = time.perf_counter()
            got = tier.get_many([hashes[i] for i in want])
            tier.stats.add(load_seconds=time.perf_counter() - t0, num_loads=1)
            for i, payload in zip(want, got):
                if payload is not None:
                    found[i], source[i] = payload, tier
            if all(p is not None for p in found):
                break
        out = []
        for h, payload, tier in zip(hashes, found, source):
            if payload is None:
                break
            tier.stats.add(hits=1, bytes_loaded=len(payload))
            if tier is not self.host and self.host is not None:
                self.host.put(h, payload)  # next time it comes from RAM
            out.append(payload)
        if len(out) < len(hashes):
            for tier in self.tiers:
                if shared_ok or not tier.shared:
                    tier.stats.add(misses=1)
        return out

    # --- stores --------------------------------------------------------------------------
    def store(self, entries: list, payloads: list[bytes]) -> None:
        """`entries`: step_batch.TierStore (hash, parent, tokens, adapter, shared)."""
        stored = []
        for entry, payload in zip(entries, payloads):
            if self.host is not None and not self.host.contains(entry.block_hash):
                if self.host.put(entry.block_hash, payload):
                    stored.append(entry)
            if entry.shared and self._slow:
                try:
                    self._queue.put_nowait((entry, payload))
                except queue.Full:
                    self.num_dropped_writes += 1
        if self.events is not None and stored and self.host is not None:
            self.events.stored(stored, self.host.medium)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                entry, payload = item
                for tier in self._slow:
                    if tier.contains(entry.block_hash):
                        continue
                    if tier.put(entry.block_hash, payload) and self.events is not None:
                        self.events.stored([entry], tier.medium)
            except Exception:  # noqa: BLE001 - a tier's bug must not stop the writer
                logger.exception("KV tier writer: a store failed")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        if self._writer is not None:
            self._queue.join()
        if self.events is not None:
            self.events.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=10)
            self._writer = None
        for tier in self.tiers:
            tier.close()
