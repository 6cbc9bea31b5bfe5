"""A sequence's speculative-decoding state.

Adaptive speculation, so that text the proposer can't predict costs about what it costs
without speculation:
- how many tokens it proposes follows how many were accepted (the heuristic transformers'
  assisted generation uses): all accepted, two more next time; a rejection, one more than
  were accepted;
- a sequence whose recent verifications accepted less than `min_rate` of their proposals
  stops proposing for a while, a cool-down that doubles each time it fails again.
"""

from __future__ import annotations

from collections import deque

FIRST_COOLDOWN = 16   # steps without proposals after the first bad window
MAX_COOLDOWN = 256


class SpecState:
    """One sequence's acceptance record (and its draft model's progress)."""

    def __init__(self, max_k: int, window: int, min_rate: float) -> None:
        self.max_k, self.window, self.min_rate = max_k, window, min_rate
        self.k = max_k  # proposals next time: start hopeful, shrink on the first rejection
        self.recent: deque[tuple[int, int]] = deque()  # (proposed, accepted) per verification
        self.cooldown = 0          # steps left without proposals
        self.next_cooldown = FIRST_COOLDOWN
        # a draft model's KV of this sequence is valid below this position, for the blocks it
        # held at this many preemptions (draft.py)
        self.draft_computed = 0
        self.draft_preemptions = 0

    def proposals_now(self, adaptive: bool) -> int:
        """How many tokens to propose this step (0: none)."""
        if not adaptive:
            return self.max_k
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        return self.k

    def record(self, proposed: int, accepted: int, adaptive: bool) -> None:
        if not adaptive or proposed == 0:
            return
        self.k = min(self.max_k, self.k + 2) if accepted == proposed else accepted + 1
        self.recent.append((proposed, accepted))
        if len(self.recent) < self.window:
            return
        total = sum(p for p, _ in self.recent)
        hits = sum(a for _, a in self.recent)
        self.recent.popleft()
        if hits < self.min_rate * total:
            self.cooldown = self.next_cooldown
            self.next_cooldown = min(2 * self.next_cooldown, MAX_COOLDOWN)
            self.recent.clear()
        elif hits >= 2 * self.min_rate * total:
            self.next_cooldown = FIRST_COOLDOWN
