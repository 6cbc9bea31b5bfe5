"""A shared Redis / Valkey server (--kv-offloading-remote redis://host:port): replicas of one
deployment share blocks, so a prefix prefilled on one is a hit on the others.

Keys are `quire:kv:<fingerprint>:<block hash>`, values framed records (framing.py), so another
model's or a corrupt value is a miss. The server's own memory policy bounds it (the chart's
Valkey runs with maxmemory and allkeys-lru). An unreachable server degrades to misses: one
warning, the errors counter, and no further tries for a few seconds, so requests never wait on
a dead server for more than one short timeout.
"""

from __future__ import annotations

import logging
import time

import redis

from quire.kv_tiers.framing import FrameError, frame, unframe
from quire.kv_tiers.tier import KVTier
from quire.kv_tiers.warn_once import forget, warn_once

logger = logging.getLogger(__name__)
TIMEOUT_S = 0.5        # one lookup or store waits at most this long on the server
RETRY_AFTER_S = 5.0    # after a failure, skip the server this long


def client_url(url: str) -> str:
    """valkey:// and valkeys:// are redis:// and rediss:// to the client library."""
    for prefix, same in (("valkey://", "redis://"), ("valkeys://", "rediss://")):
        if url.startswith(prefix):
            return same + url[len(prefix):]
    return url


class RemoteTier(KVTier):
    name = "remote"
    medium = "REMOTE"
    shared = True

    def __init__(self, url: str, fingerprint: bytes) -> None:
        super().__init__()
        self.url = url
        self.fingerprint = fingerprint
        self._prefix = b"quire:kv:" + fingerprint.hex()[:32].encode() + b":"
        self._client = redis.Redis.from_url(client_url(url), socket_timeout=TIMEOUT_S,
                                            socket_connect_timeout=TIMEOUT_S)
        self._down_until = 0.0
        self.available = True

    def _key(self, block_hash: bytes) -> bytes:
        return self._prefix + block_hash.hex().encode()

    def get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        if not hashes or not self._usable():
            return [None] * len(hashes)
        try:
            values = self._client.mget([self._key(h) for h in hashes])
        except redis.RedisError as e:
            self._failed(e)
            return [None] * len(hashes)
        self._ok()
        out = []
        for h, value in zip(hashes, values):
            if value is None:
                out.append(None)
                continue
            try:
                out.append(unframe(value, self.fingerprint, h))
            except FrameError as e:
                warn_once(logger, self.name, "bad-value", "remote KV tier: ignoring the value "
                          "of %s (%s); such values are misses", self._key(h).decode(), e)
                self.stats.add(errors=1)
                out.append(None)
        return out

    def put(self, block_hash: bytes, payload: bytes) -> bool:
        if not self._usable():
            return False
        try:
            self._client.set(self._key(block_hash), frame(self.fingerprint, block_hash, payload))
        except redis.RedisError as e:
            self._failed(e)
            return False
        self._ok()
        self.stats.add(stores=1, bytes_stored=len(payload))
        return True

    def close(self) -> None:
        self._client.close()

    def _usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, error: Exception) -> None:
        self.stats.add(errors=1)
        self.available = False
        self._down_until = time.monotonic() + RETRY_AFTER_S
        warn_once(logger, self.name, "down", "remote KV tier %s unreachable (%s): its blocks "
                  "are misses until it answers again", self.url, error)

    def _ok(self) -> None:
        if not self.available:
            logger.info("remote KV tier %s answers again", self.url)
            forget(self.name, "down")
        self.available = True
