"""Continuous batching: which requests run this step, and how many tokens each computes.

One token budget per step covers decodes and prefill chunks alike. Order of service:
running decodes, then running prefills (chunked), then waiting requests (FCFS). When blocks
run out, the most recently admitted request is preempted (by recompute, or by swap when the
host pool has room) so the older ones always make progress.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)   # batch order: decodes first
    num_new_tokens: list[int] = field(default_factory=list)
    forks: dict[str, list[Request]] = field(default_factory=dict)  # parent id -> children
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) block ids
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    preempted: list[Request] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # per scheduled request
    lora_keys_in_use: frozenset[int] = frozenset()  # adapters of running requests (pinned)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def empty(self) -> bool:
        return not self.requests and not self.swap_out


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 swapper=None, lora_admission=None) -> None:
        self.kv = kv
        self.lora_admission = lora_admission  # quire.lora.admission, when LoRA is on
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.swapper = swapper  # a SwapManager when preemption_mode == 'swap'
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.num_preemptions = {"recompute": 0, "swap": 0}

    # --- queues --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return len(self.running) + sum(len(r.pending_forks) for r in self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of whatever queue holds it and give back its blocks."""
        if request.finished:
            return
        was = request.status
        request.status = status
        if was == RequestStatus.RUNNING:
            self.running.remove(request)
        elif was == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif was == RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.swapper.free(request)
        self.kv.free(request)
        request.metrics.finished_time = time.time()
        for child in request.pending_forks:  # never forked: they end with their parent
            child.status = status
            child.metrics.finished_time = request.metrics.finished_time
        request.pending_forks = []

    # --- the step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()

        def add(req: Request, n: int, copies) -> None:
            nonlocal budget
            out.requests.append(req)
            out.num_new_tokens.append(n)
            out.block_copies.extend(copies)
            scheduled.add(req.request_id)
            budget -= n

        # 1) running decodes, 2) running prefills (a chunk each, as budget allows)
        for decoding in (True, False):
            i = 0
            while i < len(self.running) and budget > 0:
                req = self.running[i]
                i += 1
                todo = req.num_tokens_to_compute
                if todo == 0 or req.request_id in scheduled or (todo == 1) != decoding:
                    continue  # (nothing to compute: a beam waiting for its siblings)
                n = min(todo, budget)
                copies = self.kv.allocate_slots(req, n)
                while copies is None:
                    victim = self._pick_victim(after=req, scheduled=scheduled)
                    if victim is None:
                        break
                    if self.running.index(victim) < i:
                        i -= 1
                    self._preempt(victim, out)
                    copies = self.kv.allocate_slots(req, n)
                if copies is None and not decoding:
                    n = self._fitting_chunk(req, n)  # take what fits; older requests go on
                    copies = self.kv.allocate_slots(req, n) if n else None
                if copies is None:
                    if decoding:
                        i = self.running.index(req)
                        self._preempt(req, out)  # youngest of all: step aside
                    continue
                add(req, n, copies)

        lora = self.lora_admission
        if lora is not None:
            lora.start_step(self.running)
        # 3) swapped requests come back before waiting ones
        while self.swapped and budget > 0:
            req = self.swapped[0]
            n = min(req.num_tokens_to_compute, budget)
            if (self.num_running_seqs + req.group_size > self.max_num_seqs
                    or (lora is not None and not lora.try_admit(req))
                    or not self.swapper.try_swap_in(req, n, out)):
                break
            self.swapped.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            add(req, n, self.kv.allocate_slots(req, n))

        # 4) waiting requests, first come first served
        if not self.swapped:
            skipped = []  # their adapter would exceed max_loras: they keep their place
            while self.waiting and budget > 0:
                req = self.waiting[0]
                if lora is not None and not lora.try_admit(req):
                    skipped.append(self.waiting.popleft())
                    continue
                if self.num_running_seqs + req.group_size > self.max_num_seqs:
                    break
                computed, num_computed = self.kv.get_computed_blocks(req)
                n = min(req.num_tokens - num_computed, budget)
                copies = self.kv.allocate_slots(req, n, computed)
                if copies is None:
                    break
                self.waiting.popleft()
                self.kv.record_prefix_lookup(req.num_tokens, num_computed)
                req.num_computed_tokens = num_computed
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_computed
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = time.time()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                add(req, n, copies)
            self.waiting.extendleft(reversed(skipped))

        if lora is not None:
            out.lora_keys_in_use = lora.in_use(self.running)
        for req, n in zip(out.requests, out.num_new_tokens):
            out.block_tables.append(self.kv.block_ids(req))
            if req.pending_forks and req.num_computed_tokens + n == req.num_tokens:
                out.forks[req.request_id] = list(req.pending_forks)
        return out

    def _pick_victim(self, after: Request, scheduled: set[str]) -> Request | None:
        """The most recently admitted running request that is younger than `after` and not
        yet part of this step."""
        for victim in reversed(self.running):
            if victim is after:
                return None
            if victim.request_id not in scheduled:
                return victim
        return None

    def _fitting_chunk(self, req: Request, n: int) -> int:
        free_slots = self.kv.pool.num_free_blocks * self.kv.block_size
        blocks = self.kv.req_blocks.get(req.request_id, [])
        room_in_last = len(blocks) * self.kv.block_size - req.num_computed_tokens
        return max(0, min(n, free_slots + room_in_last))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        req.num_preemptions += 1
        out.preempted.append(req)
        if self.swapper is not None and self.swapper.try_swap_out(req, out):
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            self.num_preemptions["swap"] += 1
            logger.debug("preempted %s by swap", req.request_id)
            return
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions["recompute"] += 1
        logger.debug("preempted %s by recompute", req.request_id)

    # --- after the forward ---------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, fork siblings, apply token stops.
        Returns the requests that got a new token (finished ones included)."""
        self.kv.step_done()
        updated = []
        for req, n in zip(out.requests, out.num_new_tokens):
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += n
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prefill chunk that does not reach the end of the prompt
            if req.beam is not None:  # its beam search group picks the next token
                updated.append(req)
                continue
            children = out.forks.get(req.request_id, ())
            for child in children:
                self.kv.fork(req, child)
                child.num_computed_tokens = req.num_computed_tokens
                child.num_cached_tokens = req.num_cached_tokens
                child.metrics.first_scheduled_time = req.metrics.first_scheduled_time
                child.status = RequestStatus.RUNNING
                self.running.append(child)
            req.pending_forks = []
            for r in (req, *children):
                r.append_token(sampled[r.request_id])
                updated.append(r)
                status = r.check_stop()
                if status is not None:
                    self.finish(r, status)
        return updated

    def step_failed(self, out: SchedulerOutput) -> None:
        self.kv.step_failed()
