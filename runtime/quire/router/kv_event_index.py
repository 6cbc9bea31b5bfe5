"""Which replica really holds which KV blocks, and in which tier, from the replicas' own
KV-cache events (vLLM's format, quire/kv_events): the index behind `--routing
precise-prefix`.

BlockStored adds (block, replica, medium), BlockRemoved takes it away, AllBlocksCleared forgets
the replica. A block in the shared REMOTE tier is a hit for every replica. A replica's score
for a prompt is the run of its leading blocks that it holds somewhere, each weighted by its
best tier (the pool beats host RAM beats disk beats the shared server: what a load costs).
"""

from __future__ import annotations

import threading
from collections import defaultdict

TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "REMOTE": 0.3}
SHARED_MEDIA = ("REMOTE",)


class KVEventIndex:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        self.max_blocks = max_blocks
        # block hash -> replica URL -> media it holds the block in
        self._holders: dict[bytes, dict[str, set[str]]] = defaultdict(dict)
        self._shared: set[bytes] = set()  # blocks in a shared tier: everyone's
        self.num_events = 0
        self.lock = threading.Lock()  # the subscriber's thread writes, the event loop reads

    def __len__(self) -> int:
        return len(self._holders)

    # --- updates -------------------------------------------------------------------------
    def stored(self, url: str, hashes: list, medium: str | None) -> None:
        with self.lock:
            self._stored(url, hashes, medium or "GPU")

    def _stored(self, url: str, hashes: list, medium: str) -> None:
        for h in hashes:
            h = _key(h)
            if medium in SHARED_MEDIA:
                self._shared.add(h)
                continue
            if len(self._holders) >= self.max_blocks and h not in self._holders:
                continue  # bounded: a full index stops learning new blocks (misses, not lies)
            self._holders[h].setdefault(url, set()).add(medium)

    def removed(self, url: str, hashes: list, medium: str | None) -> None:
        with self.lock:
            self._removed(url, hashes, medium or "GPU")

    def _removed(self, url: str, hashes: list, medium: str) -> None:
        for h in hashes:
            h = _key(h)
            if medium in SHARED_MEDIA:
                self._shared.discard(h)
                continue
            owners = self._holders.get(h)
            if not owners or url not in owners:
                continue
            owners[url].discard(medium)
            if not owners[url]:
                del owners[url]
            if not owners:
                del self._holders[h]

    def forget(self, url: str) -> None:
        """The replica is gone, or cleared its cache."""
        with self.lock:
            self._forget(url)

    def _forget(self, url: str) -> None:
        for h in [h for h, owners in self._holders.items() if url in owners]:
            del self._holders[h][url]
            if not self._holders[h]:
                del self._holders[h]

    # --- reads ---------------------------------------------------------------------------
    def scores(self, hashes: list[bytes], urls: set[str]) -> dict[str, float]:
        """url -> the tier-weighted length of the leading run of blocks it holds."""
        with self.lock:
            return self._scores(hashes, urls)

    def _scores(self, hashes: list[bytes], urls: set[str]) -> dict[str, float]:
        out = dict.fromkeys(urls, 0.0)
        alive = set(urls)
        for h in hashes:
            owners = self._holders.get(h, {})
            shared = h in self._shared
            for url in list(alive):
                media = owners.get(url)
                if media:
                    out[url] += max(TIER_WEIGHTS.get(m, 0.1) for m in media)
                elif shared:
                    out[url] += TIER_WEIGHTS["REMOTE"]
                else:
                    alive.discard(url)
            if not alive:
                break
        return out


def _key(h) -> bytes:
    """Our replicas send 32-byte digests; vLLM's may send ints: keep them apart by type."""
    return h if isinstance(h, bytes) else int(h).to_bytes(16, "big", signed=True)
