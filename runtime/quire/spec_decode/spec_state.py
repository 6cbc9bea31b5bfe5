"""A sequence's speculative-decoding state.

Adaptive speculation: a sequence whose recent proposals are mostly rejected stops proposing
for a while (a cool-down that doubles each time it fails again), so free-form text that the
proposer can't predict costs what it costs without speculation."""

from __future__ import annotations

from collections import deque

FIRST_COOLDOWN = 16   # steps without proposals after the first bad window
MAX_COOLDOWN = 256


class SpecState:
    """One sequence's acceptance record (and its draft model's progress)."""

    def __init__(self, window: int, min_rate: float) -> None:
        self.window, self.min_rate = window, min_rate
        self.recent: deque[tuple[int, int]] = deque()  # (proposed, accepted) per step
        self.num_proposed = 0
        self.num_accepted = 0
        self.cooldown = 0          # steps left without proposals
        self.next_cooldown = FIRST_COOLDOWN
        # a draft model's KV of this sequence is valid below this position, for the blocks it
        # held at this many preemptions (draft.py)
        self.draft_computed = 0
        self.draft_preemptions = 0

    def may_propose(self) -> bool:
        if self.cooldown > 0:
            self.cooldown -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int, adaptive: bool) -> None:
        if not adaptive or proposed == 0:
            return
        self.recent.append((proposed, accepted))
        self.num_proposed += proposed
        self.num_accepted += accepted
        while self.num_proposed - self.recent[0][0] >= self.window:
            p, a = self.recent.popleft()
            self.num_proposed -= p
            self.num_accepted -= a
        if self.num_proposed < self.window:
            return
        if self.num_accepted < self.min_rate * self.num_proposed:
            self.cooldown = self.next_cooldown
            self.next_cooldown = min(2 * self.next_cooldown, MAX_COOLDOWN)
            self.recent.clear()
            self.num_proposed = self.num_accepted = 0
        else:
            self.next_cooldown = FIRST_COOLDOWN
