"""Routing policies: given the replicas not yet tried for this request, pick one.

- round-robin: in turn, ignoring load;
- least-load: the lowest `Backend.load()` (scraped queue + running, our own in-flight
  requests since the scrape, KV pressure); ties go round-robin so equal replicas share;
- prefix-aware: the replica that holds the longest run of the prompt's leading KV blocks,
  unless it is overloaded (bounded load: more than (1 + load_factor) x the mean load plus
  `load_slack` requests), in which case least-load; no match at all is least-load too.
- precise-prefix: as prefix-aware, but the replicas' own KV-cache events say who holds which
  blocks and in which tier (kv_event_index.py), not this router's history: a replica that
  evicted a prefix stops attracting it, one that got it by another path (another router, a
  shared tier) starts; the longest tier-weighted run wins.

Each pick says why (`Choice.reason`): that is the routing-decision metric's label.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from quire.router.backends import Backend
from quire.router.prefix_index import PrefixIndex

POLICIES = ("round-robin", "least-load", "prefix-aware", "precise-prefix")


@dataclass(frozen=True)
class Choice:
    backend: Backend
    reason: str  # round_robin, least_load, prefix_hit, prefix_overloaded, prefix_miss


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: list[Backend], hashes: list[bytes]) -> Choice:
        ordered = sorted(candidates, key=lambda b: b.url)
        return Choice(ordered[next(self._counter) % len(ordered)], "round_robin")

    def routed(self, backend: Backend, hashes: list[bytes]) -> None:
        pass

    def forget(self, url: str) -> None:
        pass


class LeastLoad(RoundRobin):
    name = "least-load"

    def pick(self, candidates: list[Backend], hashes: list[bytes]) -> Choice:
        return Choice(self._least_loaded(candidates), "least_load")

    def _least_loaded(self, candidates: list[Backend]) -> Backend:
        lowest = min(b.load() for b in candidates)
        tied = sorted((b for b in candidates if b.load() <= lowest), key=lambda b: b.url)
        return tied[next(self._counter) % len(tied)]


class PrefixAware(LeastLoad):
    name = "prefix-aware"

    def __init__(self, index: PrefixIndex, load_factor: float = 1.0,
                 load_slack: float = 4.0) -> None:
        super().__init__()
        if load_factor < 0 or load_slack < 0:
            raise ValueError("load_factor and load_slack must be >= 0")
        self.index = index
        self.load_factor = load_factor
        self.load_slack = load_slack

    def overloaded(self, backend: Backend, candidates: list[Backend]) -> bool:
        mean = sum(b.load() for b in candidates) / len(candidates)
        return backend.load() > (1.0 + self.load_factor) * mean + self.load_slack

    def pick(self, candidates: list[Backend], hashes: list[bytes]) -> Choice:
        holders, matched = self.index.longest_match(hashes, {b.url for b in candidates})
        if not matched:
            return Choice(self._least_loaded(candidates), "prefix_miss")
        best = self._least_loaded([b for b in candidates if b.url in holders])
        if self.overloaded(best, candidates):
            return Choice(self._least_loaded(candidates), "prefix_overloaded")
        return Choice(best, "prefix_hit")

    def routed(self, backend: Backend, hashes: list[bytes]) -> None:
        self.index.record(hashes, backend.url)

    def forget(self, url: str) -> None:
        self.index.forget(url)


class PrecisePrefix(PrefixAware):
    name = "precise-prefix"

    def __init__(self, events_index, load_factor: float = 1.0, load_slack: float = 4.0) -> None:
        super().__init__(PrefixIndex(1), load_factor, load_slack)
        self.events_index = events_index  # a KVEventIndex, fed by KVEventSubscriber

    def pick(self, candidates: list[Backend], hashes: list[bytes]) -> Choice:
        scores = self.events_index.scores(hashes, {b.url for b in candidates})
        top = max(scores.values(), default=0.0)
        if top <= 0:
            return Choice(self._least_loaded(candidates), "prefix_miss")
        best = self._least_loaded([b for b in candidates if scores[b.url] >= top])
        if self.overloaded(best, candidates):
            return Choice(self._least_loaded(candidates), "prefix_overloaded")
        return Choice(best, "prefix_hit")

    def routed(self, backend: Backend, hashes: list[bytes]) -> None:
        pass  # the replica's events will say what it holds

    def forget(self, url: str) -> None:
        self.events_index.forget(url)


def make_policy(name: str, index: PrefixIndex | None = None, load_factor: float = 1.0,
                load_slack: float = 4.0, events_index=None):
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "prefix-aware":
        return PrefixAware(index or PrefixIndex(), load_factor, load_slack)
    if name == "precise-prefix":
        from quire.router.kv_event_index import KVEventIndex
        return PrecisePrefix(events_index if events_index is not None else KVEventIndex(),
                             load_factor, load_slack)
    raise ValueError(f"routing must be one of {', '.join(POLICIES)}; got {name!r}")
