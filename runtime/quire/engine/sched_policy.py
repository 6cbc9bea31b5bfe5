"""The scheduler's queue policy: which waiting sequence is admitted next, in what order the
running ones are served, and whether a waiting one may preempt running ones.

    policy = make_queue_policy("priority")       # or "fcfs" (the default)
    policy.enqueue(scheduler.waiting, seq)       # a new sequence
    policy.requeue(scheduler.waiting, seq)       # a preempted one, back in its place
    policy.order_units(units)                    # running units, most urgent first
    policy.preempt_for_waiting(scheduler, out)   # before the step: make room for urgent ones

vLLM's semantics (`--scheduling-policy priority`): a request's `priority` is an integer,
lower is served first, ties go by arrival. Under `priority` a waiting sequence that can't be
admitted for want of KV blocks (or of a sequence slot) preempts running units of a strictly
worse priority, the worst and youngest first; under `fcfs` priorities are accepted and
ignored (as vLLM's V1 engine does) and the scheduler behaves exactly as it always has.

The policy reads `seq.priority` (set when the Request is made; 0 by default) and
`seq.metrics.arrival_time`; it never touches blocks itself: preemption goes through the
scheduler's own `_preempt`, so the KV bookkeeping stays in one place.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque

from quire.priorities import MAX_PRIORITY, MIN_PRIORITY, SCHEDULING_POLICIES  # noqa: F401

logger = logging.getLogger(__name__)

BAND_LIMIT = 10  # priorities beyond +-10 share a metric band


def priority_of(seq) -> int:
    return seq.priority


def sort_key(seq) -> tuple[int, float]:
    """Lower is more urgent: (priority, arrival time)."""
    return priority_of(seq), seq.metrics.arrival_time


class FcfsPolicy:
    name = "fcfs"

    def enqueue(self, waiting: deque, seq) -> None:
        waiting.append(seq)

    def requeue(self, waiting: deque, seq) -> None:
        """A preempted sequence goes back to the front (it is older than every waiter)."""
        waiting.appendleft(seq)

    def order_units(self, units: list[list]) -> list[list]:
        return units

    def arrival_order(self, seqs: list) -> list:
        """Sequences put back in front of the queue (grammar compiling, no LoRA slot)."""
        return sorted(seqs, key=lambda s: s.metrics.arrival_time)

    def preempt_for_waiting(self, scheduler, out) -> None:
        pass  # admission never preempts under FCFS


class PriorityPolicy(FcfsPolicy):
    name = "priority"

    def enqueue(self, waiting: deque, seq) -> None:
        # after every waiter of an equal key: ties keep their arrival order
        _insert(waiting, seq, bisect.bisect_right)

    def requeue(self, waiting: deque, seq) -> None:
        # before equal keys: a unit requeued member by member, last first, keeps its order
        _insert(waiting, seq, bisect.bisect_left)

    def order_units(self, units: list[list]) -> list[list]:
        # stable: admission order breaks ties, so equal priorities behave as FCFS does
        return sorted(units, key=lambda unit: priority_of(unit[0]))

    def arrival_order(self, seqs: list) -> list:
        return sorted(seqs, key=sort_key)

    def preempt_for_waiting(self, scheduler, out) -> None:
        """Before the step is scheduled: while the most urgent waiting sequence is more
        urgent than the least urgent running unit and would not fit (blocks for its first
        chunk, or a sequence slot), preempt that unit. vLLM's priority preemption."""
        kv = scheduler.kv_manager
        head = next((s for s in scheduler.waiting if scheduler.runnable(s)), None)
        while head is not None:  # (one still compiling could not run this step anyway)
            units = self.order_units(scheduler._running_units())
            if not units or priority_of(units[-1][0]) <= priority_of(head):
                return
            chunk = min(head.num_tokens - head.num_computed_tokens,
                        scheduler.max_num_batched_tokens)
            # the running decodes that open a new block this step need theirs too
            growing = sum(1 for s in scheduler.running if s.num_tokens % kv.block_size == 0)
            fits_blocks = kv.blocks_needed(chunk) + growing <= kv.num_free_blocks
            fits_seqs = scheduler.num_running_seqs + head.num_seqs <= scheduler.max_num_seqs
            if fits_blocks and fits_seqs:
                return
            victim = units[-1]
            logger.debug("priority %d request %s preempts priority %d %s", priority_of(head),
                         head.request_id, priority_of(victim[0]), victim[0].request_id)
            # by recompute even in swap mode: swapped units come back before any waiter, so a
            # swapped victim would be back ahead of the request it made room for
            swapper, scheduler.swapper = scheduler.swapper, None
            try:
                scheduler._preempt(victim, out)
            finally:
                scheduler.swapper = swapper


def priority_band(priority: int) -> str:
    """A metric label with bounded cardinality: the priority itself within -10..10."""
    if priority < -BAND_LIMIT:
        return f"below_-{BAND_LIMIT}"
    if priority > BAND_LIMIT:
        return f"above_{BAND_LIMIT}"
    return str(priority)


def counts_by_band(seqs) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in seqs:
        band = priority_band(priority_of(seq))
        counts[band] = counts.get(band, 0) + seq.num_seqs
    return counts


def make_queue_policy(name: str):
    if name == "fcfs":
        return FcfsPolicy()
    if name == "priority":
        return PriorityPolicy()
    raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                     f"got {name!r}")


def _insert(waiting: deque, seq, bisect_fn) -> None:
    keys = [sort_key(s) for s in waiting]
    waiting.insert(bisect_fn(keys, sort_key(seq)), seq)
