"""Which replicas were sent which KV-block hashes: a bounded LRU, hash -> replica URLs.

A replica that got a prompt holds its blocks in its prefix cache until it evicts them; the
router cannot see evictions, so the index forgets the least recently routed hashes first,
and a bound of the same order as the replicas' cache sizes keeps it roughly honest.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_entries: int = 200_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._owners: OrderedDict[int, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def record(self, hashes: list[bytes], url: str) -> None:
        for h in hashes:
            owners = self._owners.get(h)
            if owners is None:
                self._owners[h] = {url}
            else:
                owners.add(url)
                self._owners.move_to_end(h)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def longest_match(self, hashes: list[bytes], urls: set[str]) -> tuple[set[str], int]:
        """The replicas among `urls` that hold the longest run of leading blocks, and how many
        blocks that is (0 and an empty set when none holds even the first)."""
        holders, matched = set(), 0
        alive = set(urls)
        for h in hashes:
            owners = self._owners.get(h)
            alive = alive & owners if owners else set()
            if not alive:
                break
            holders, matched = alive, matched + 1
            self._owners.move_to_end(h)
        return holders, matched

    def forget(self, url: str) -> None:
        """A replica went away: its cache went with it."""
        for h in [h for h, owners in self._owners.items() if url in owners]:
            owners = self._owners[h]
            owners.discard(url)
            if not owners:
                del self._owners[h]
