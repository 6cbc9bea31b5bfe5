"""Disk: one file per block under DIR/<fingerprint>/, an LRU within a byte budget
(--kv-offloading-disk-path, --kv-offloading-disk-size).

A restarted server with the same fingerprint finds its files again (the index is rebuilt from
the folder, oldest use first by modification time; a hit touches its file). Every file is a
framed record (framing.py): a corrupt, truncated or foreign file is a miss, logged once and
removed, never wrong output. Writes go to a temporary name and are renamed into place, so a
crash mid-write leaves no half file under a block's name.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from quire.kv_tiers.framing import FrameError, frame, unframe
from quire.kv_tiers.tier import KVTier
from quire.kv_tiers.warn_once import warn_once

logger = logging.getLogger(__name__)
SUFFIX = ".kv"


class DiskTier(KVTier):
    name = "disk"
    medium = "DISK"
    shared = True

    def __init__(self, path: str, capacity_bytes: int, fingerprint: bytes) -> None:
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.root = Path(path) / fingerprint.hex()[:32]
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, LRU first
        self.used_bytes = 0
        self._scan()

    def __len__(self) -> int:
        return len(self._files)

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def _scan(self) -> None:
        found = []
        for entry in self.root.glob(f"??/*{SUFFIX}"):
            try:
                h = bytes.fromhex(entry.name[:-len(SUFFIX)])
                st = entry.stat()
            except (ValueError, OSError):
                continue
            if len(h) == 32:
                found.append((st.st_mtime_ns, h, st.st_size))
        for _, h, size in sorted(found):
            self._files[h] = size
            self.used_bytes += size
        self._evict_to(self.capacity_bytes)
        if found:
            logger.info("disk KV tier %s: %d blocks (%.1f MiB) from an earlier run", self.root,
                        len(self._files), self.used_bytes / 2**20)

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._files

    def get_many(self, hashes: list[bytes]) -> list[bytes | None]:
        return [self._get(h) if h in self._files else None for h in hashes]

    def _get(self, block_hash: bytes) -> bytes | None:
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
            payload = unframe(data, self.fingerprint, block_hash)
        except FileNotFoundError:
            self._forget(block_hash)
            return None
        except (OSError, FrameError) as e:
            warn_once(logger, self.name, "bad-file", "disk KV tier: ignoring %s (%s); such "
                      "files are misses and are removed", path, e)
            self.stats.add(errors=1)
            self._forget(block_hash)
            _unlink(path)
            return None
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        return payload

    def put(self, block_hash: bytes, payload: bytes) -> bool:
        data = frame(self.fingerprint, block_hash, payload)
        if len(data) > self.capacity_bytes:
            return False
        if block_hash in self._files:
            return True
        path = self._path(block_hash)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:
            warn_once(logger, self.name, "write", "disk KV tier: cannot write %s (%s); blocks "
                      "are not kept on disk while this lasts", path, e)
            self.stats.add(errors=1)
            _unlink(tmp)
            return False
        with self._lock:
            if block_hash not in self._files:
                self._files[block_hash] = len(data)
                self.used_bytes += len(data)
        self.stats.add(stores=1, bytes_stored=len(payload))
        self._evict_to(self.capacity_bytes)
        return True

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._files.pop(block_hash, None)
            if size is not None:
                self.used_bytes -= size

    def _evict_to(self, budget: int) -> None:
        evicted = []
        with self._lock:
            while self.used_bytes > budget and self._files:
                h, size = self._files.popitem(last=False)
                self.used_bytes -= size
                evicted.append(h)
        for h in evicted:
            _unlink(self._path(h))
        self._evicted(evicted)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
