"""The periodic engine line (vLLM's "Avg prompt throughput ..."), logged by the async engine
every `interval` seconds while it has work: throughput, queues, KV use, prefix-cache hit rate,
and with speculative decoding the acceptance rate and mean accepted length."""

from __future__ import annotations

import logging
import time

from quire.engine.stats import EngineSnapshot, StepEvents

logger = logging.getLogger(__name__)


class StatsLog:
    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self._since = now
        self._prompt = self._generated = 0
        self._drafts = self._draft_tokens = self._accepted = 0
        self._prefix = None  # (queries, hits) at the window's start

    def record(self, snap: EngineSnapshot, ev: StepEvents, now: float | None = None) -> str | None:
        """Add a step's events; returns (and logs) the line when a window ends."""
        now = time.monotonic() if now is None else now
        if self._prefix is None:
            self._prefix = (snap.prefix_queries, snap.prefix_hits)
        self._prompt += ev.prompt_tokens
        self._generated += ev.generation_tokens
        self._drafts += ev.spec_drafts
        self._draft_tokens += ev.spec_draft_tokens
        self._accepted += ev.spec_accepted_tokens
        elapsed = now - self._since
        if elapsed < self.interval:
            return None
        busy = self._generated or self._prompt or snap.num_running or snap.num_waiting
        line = self._line(snap, elapsed)
        self._reset(now)
        if not busy:  # an idle server logs nothing
            return None
        logger.info("%s", line)
        return line

    def _line(self, snap: EngineSnapshot, elapsed: float) -> str:
        queries = snap.prefix_queries - self._prefix[0]
        hits = snap.prefix_hits - self._prefix[1]
        parts = [f"prompt throughput {self._prompt / elapsed:.1f} tok/s",
                 f"generation throughput {self._generated / elapsed:.1f} tok/s",
                 f"running {snap.num_running}", f"waiting {snap.num_waiting}",
                 f"KV cache {100 * snap.kv_usage:.1f}%",
                 f"prefix cache hit rate {100 * hits / queries:.1f}%" if queries
                 else "prefix cache hit rate -"]
        if self._drafts:
            parts.append(f"speculative acceptance {100 * self._accepted / self._draft_tokens:.1f}%"
                         f" ({self._accepted}/{self._draft_tokens} tokens, mean accepted length "
                         f"{1 + self._accepted / self._drafts:.2f})")
        return "engine: " + ", ".join(parts)
