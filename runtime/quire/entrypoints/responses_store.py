"""Stored responses (`store: true` on /v1/responses): what `previous_response_id` continues
from and GET /v1/responses/{id} returns. In memory, bounded by count (the oldest go first) and
by age (a TTL), so a server that answers for weeks holds at most --max-stored-responses of
them. It lives on the event loop: no locking."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class StoredResponse:
    response: dict          # the response object as the client got it
    conversation: list[dict]  # chat messages up to and including its answer (no instructions)


class ResponseStore:
    def __init__(self, max_entries: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl, self.clock = max_entries, ttl, clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._expire()
        self._entries[response_id] = (self.clock() + self.ttl, entry)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        found = self._entries.get(response_id)
        return found[1] if found is not None else None

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self.clock()
        # insertion order is expiry order (one TTL for all): drop from the front
        while self._entries:
            expires, _ = next(iter(self._entries.values()))
            if expires > now:
                break
            self._entries.popitem(last=False)
