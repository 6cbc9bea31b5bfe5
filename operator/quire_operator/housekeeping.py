"""The operator's own clock: autoscaler polls, adapter syncs and the periodic resync of every LLMDeployment.

One loop for all objects rather than kopf timers: a kopf timer (or daemon) puts a finalizer on
every object it runs for, and a finalizer blocks deleting the object whenever the operator is
down. This loop needs none. kopf's index of LLMDeployments says what exists; each object is
polled at its own pollIntervalSeconds and re-applied every `resync_seconds` (a safety net under
the watches on the children, which repair drift as it happens).

The work itself is blocking API calls and scrapes: it runs in worker threads, at most one job
per object at a time, so a slow pod delays only its own LLMDeployment. Adapter syncs (spec.adapters)
run in a lane of their own, so that a slow adapter load never delays an autoscaler poll: one runs
every `adapter_seconds`, and at the next tick whenever the entry's `adapter_trigger` changes (the
adapter list was edited, or a replica became ready).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)


@dataclass
class _Clock:
    next_resync: float
    next_poll: float = 0.0
    history: Any = None  # the autoscaler's recommendations, kept between polls
    busy: bool = False
    # The adapter-sync lane: its own schedule, memory and busy flag.
    next_adapter_sync: float = 0.0
    adapter_trigger: Any = None  # the entry's adapter_trigger the last sync started with
    adapter_history: Any = None
    adapter_busy: bool = False


@dataclass(frozen=True)
class Polled:
    """What a poll may return instead of the bare history: the history, and when to poll next
    if not at the entry's poll_seconds (faster while a scaled-to-zero object holds requests)."""
    history: Any
    next_poll_seconds: float | None = None


@dataclass
class Housekeeping:
    # poll(key, entry, history) → the history for the next poll (or a Polled); called when due
    poll: Callable[[Key, Mapping[str, Any], Any], Any]
    # resync(key): re-apply the spec
    resync: Callable[[Key], None]
    resync_seconds: float
    tick_seconds: float = 1.0
    # The context jobs run in (kopf.event() needs one of an object handler's); None: this one.
    context: Callable[[], contextvars.Context | None] = lambda: None
    # sync_adapters(key, entry, history) → the history for the next sync; for entries whose
    # "adapter_seconds" is not None.
    sync_adapters: Callable[[Key, Mapping[str, Any], Any], Any] | None = None
    _clocks: dict[Hashable, _Clock] = field(default_factory=dict)

    async def run(self, entries: Callable[[], Iterable[tuple[Key, Mapping[str, Any]]]]) -> None:
        """Forever: every tick, start the jobs that are due. `entries` lists (key, entry) where an
        entry has "poll_seconds" (None: autoscaling is off)."""
        loop = asyncio.get_running_loop()
        while True:
            self.start_due_jobs(loop, list(entries()), time.monotonic())
            await asyncio.sleep(self.tick_seconds)

    def start_due_jobs(self, loop: asyncio.AbstractEventLoop, entries: list[tuple[Key, Mapping[str, Any]]],
                       now: float) -> None:
        present = {key for key, _ in entries}
        for gone in set(self._clocks) - present:  # deleted: forget its history
            del self._clocks[gone]
        for key, entry in entries:
            # The first resync of an object comes one period after the operator first saw it.
            clock = self._clocks.setdefault(key, _Clock(next_resync=now + self.resync_seconds))
            self._start_adapter_sync_if_due(loop, key, entry, clock, now)
            if clock.busy:
                continue
            resync = now >= clock.next_resync
            poll_seconds = entry.get("poll_seconds")
            poll = poll_seconds is not None and now >= clock.next_poll
            if resync:
                clock.next_resync = now + self.resync_seconds
            if poll:
                clock.next_poll = now + poll_seconds
            if resync or poll:
                self._start(loop, key, clock,
                            lambda k=key, e=entry, c=clock, r=resync, p=poll: self._job(k, e, c, r, p, now))

    def _start_adapter_sync_if_due(self, loop: asyncio.AbstractEventLoop, key: Key, entry: Mapping[str, Any],
                                   clock: _Clock, now: float) -> None:
        seconds = entry.get("adapter_seconds")
        if self.sync_adapters is None or seconds is None or clock.adapter_busy:
            return
        trigger = entry.get("adapter_trigger")
        if now < clock.next_adapter_sync and trigger == clock.adapter_trigger:
            return
        clock.next_adapter_sync, clock.adapter_trigger = now + seconds, trigger
        sync = self.sync_adapters

        def job() -> None:
            clock.adapter_history = sync(key, entry, clock.adapter_history)

        self._run_in_thread(loop, key, job, lambda busy: setattr(clock, "adapter_busy", busy))

    def _job(self, key: Key, entry: Mapping[str, Any], clock: _Clock, resync: bool, poll: bool,
             started: float) -> None:
        if resync:
            self.resync(key)
        if poll:
            result = self.poll(key, entry, clock.history)
            if isinstance(result, Polled):
                clock.history = result.history
                if result.next_poll_seconds is not None:
                    clock.next_poll = min(clock.next_poll, started + result.next_poll_seconds)
            else:
                clock.history = result

    def _start(self, loop: asyncio.AbstractEventLoop, key: Key, clock: _Clock, job: Callable[[], None]) -> None:
        self._run_in_thread(loop, key, job, lambda busy: setattr(clock, "busy", busy))

    def _run_in_thread(self, loop: asyncio.AbstractEventLoop, key: Key, job: Callable[[], None],
                       set_busy: Callable[[bool], None]) -> None:
        set_busy(True)

        def run() -> None:
            try:
                job()
            except Exception:  # one object's failure is logged, never the loop's end
                log.exception("%s/%s: housekeeping failed; the next tick tries again", *key)
            finally:
                set_busy(False)

        # A fresh copy per job: one context cannot be entered by two threads at once.
        base = self.context() or contextvars.copy_context()
        loop.run_in_executor(None, base.copy().run, run)
