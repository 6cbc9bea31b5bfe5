"""Continuous batching: which sequences run this step, and how many tokens each computes.

One token budget per step covers decodes and prefill chunks alike. Order of service: running
decodes, then running prefills (chunked), then swapped sequences, then waiting ones (FCFS).
A beam group is scheduled and preempted as a *unit* (its live beams advance in lockstep, so
they run together or not at all); any other sequence is a unit of its own. When blocks run
out, the most recently admitted unit is preempted (a lone sequence by swap when the host pool
has room, else by recompute) so the older ones always make progress.

Public interface (the only way to add, fork or finish sequences):
    add_request(seq)                 queue a new sequence (its pending siblings ride along)
    schedule() -> SchedulerOutput    one step: batch, preemptions, swaps, copies; what can
                                     never progress is failed (out.stuck), not spun on
    update(out, sampled) -> [seq]    after the forward: counts, tokens (several where
                                     proposals were accepted), n>1 forks, token stops
    fork(parent, child)              a new running sibling sharing the parent's blocks
    finish(seq, status)              out of every queue, its blocks given back
    step_failed(out)                 the forward raised: forget the blocks cached this step
    drop_from_step(out, seqs)        some sequences can't run (no LoRA slot): fail them alone
    has_unfinished(), num_running_seqs, num_preemptions; running / waiting / swapped (read)
"""

from __future__ import annotations

import logging
from collections import deque

from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.request import Request, RequestStatus
from quire.engine.sched_policy import make_queue_policy
from quire.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, swapper=None, lora_admission=None,
                 rope_switch_length: int | None = None,
                 scheduling_policy: str = "fcfs") -> None:
        self.kv_manager = kv_manager
        # fcfs or priority: queue order, service order, priority preemption (sched_policy.py)
        self.policy = make_queue_policy(scheduling_policy)
        # LongRoPE (Phi-3): a sequence of this many tokens or more rotates with the long table,
        # shorter ones with the short table, and transformers recomputes a sequence's K/V when
        # it grows across the switch. So does this scheduler (by recompute), and the two
        # tables' blocks never share the prefix cache (their hash chains are salted apart).
        self.rope_switch_length = rope_switch_length
        self.lora_admission = lora_admission  # quire.lora.admission, when LoRA is on
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.swapper = swapper  # a SwapManager when preemption_mode == 'swap'
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.swapped: deque[Request] = deque()
        self.num_preemptions = {"recompute": 0, "swap": 0}

    # --- queues ----------------------------------------------------------------------------
    def add_request(self, seq: Request) -> None:
        if self.lora_admission is not None:  # its adapter stays until it ends
            self.lora_admission.hold(seq)
        if self.rope_switch_length and seq.num_tokens >= self.rope_switch_length:
            seq.long_rope = True
        self.policy.enqueue(self.waiting, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return len(self.running) + sum(len(s.pending_siblings) for s in self.running)

    def fork(self, parent: Request, child: Request) -> None:
        """`child` (a new sibling with the parent's tokens) shares every block of `parent`
        and runs from the next step, placed right after its parent (same age)."""
        self.kv_manager.fork(parent, child)
        child.start_running(parent.num_computed_tokens, parent)
        self.running.insert(self.running.index(parent) + 1, child)

    def finish(self, seq: Request, status: RequestStatus) -> None:
        """Take a sequence out of whatever queue holds it and give back its blocks."""
        if seq.status == RequestStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == RequestStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == RequestStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swapper.free(seq)
        else:
            return  # finished already
        self.kv_manager.free(seq)
        ended = (seq, *seq.pending_siblings)
        seq.end(status)
        if self.lora_admission is not None:
            self.lora_admission.release(ended)

    # --- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.policy.preempt_for_waiting(self, out)  # priority: room for urgent waiters
        self._budget = self.max_num_batched_tokens
        self._scheduled: set[str] = set()
        self._num_compiling = 0
        # decodes come before proposals: what proposals may use is the budget less these
        self._decodes_left = sum(1 for s in self.running if s.num_tokens_to_compute == 1)
        # Each pass walks a snapshot of the running units, oldest first. Preemption only ever
        # removes units younger than the one being served (or that one itself), so the walk
        # never revisits or skips a live unit: preempted ones are skipped by their status.
        for decoding in (True, False):
            units = self._running_units()
            for unit in units:
                if self._budget <= 0:
                    break
                if unit[0].status == RequestStatus.RUNNING:
                    self._serve(unit, units, decoding, out)
        if not out.preempted:  # a step that had to preempt has no room to bring any back
            self._swap_in_and_admit(out)
        if self.lora_admission is not None:  # adapters of running sequences stay pinned
            out.lora_keys_in_use = self.lora_admission.in_use(self.running)
        for seq, n in zip(out.requests, out.num_new_tokens):
            out.block_tables.append(self.kv_manager.block_ids(seq))
            if seq.pending_siblings and seq.num_computed_tokens + n == seq.num_tokens:
                out.forks[seq.request_id] = list(seq.pending_siblings)
        # (a sequence waiting for its grammar to compile is not stuck: it will come)
        if (not out.requests and not out.swap_out and not out.preempted
                and not self._num_compiling and self.has_unfinished()):
            self._fail_stuck(out, [*self.running, *self.swapped, *self.waiting])
        return out

    def _serve(self, unit: list[Request], units: list[list[Request]], decoding: bool,
               out: SchedulerOutput) -> None:
        todo = [s for s in unit if s.num_tokens_to_compute > 0]  # 0: a beam awaiting siblings
        is_decode = bool(todo) and all(s.num_tokens_to_compute == 1 for s in todo)
        if not todo or is_decode != decoding:
            return
        if decoding:  # all of the unit's decodes, or none of them
            if len(todo) > self._budget:
                return
            if self.rope_switch_length and any(self._crosses_rope_switch(s) for s in todo):
                self._recompute_for_rope(unit, out)
                return
            self._fit_proposals(todo)
            while self.kv_manager.num_blocks_to_grow(
                    todo, [1 + len(s.spec_token_ids) for s in todo]) \
                    > self.kv_manager.num_free_blocks:
                if any(s.spec_token_ids for s in todo):  # proposals go before anyone else
                    for s in todo:
                        s.spec_token_ids = []
                    continue
                victim = self._pick_victim(unit, units)
                if victim is not None:
                    self._preempt(victim, out)
                    continue
                if any(g is not unit and g[0].status == RequestStatus.RUNNING for g in units):
                    self._preempt(unit, out)  # none younger: the unit steps aside
                else:  # it holds the cache alone: stepping aside would only come back here
                    self._fail_stuck(out, unit)
                return
            for seq in todo:
                k = len(seq.spec_token_ids)
                self._add(seq, 1 + k, self.kv_manager.allocate_slots(seq, 1, num_lookahead=k),
                          out)
                if k:
                    out.spec_token_ids[seq.request_id] = seq.spec_token_ids
            return
        for seq in todo:  # prefills: a chunk each, as budget and blocks allow
            n = min(seq.num_tokens_to_compute, self._budget)
            copies = self.kv_manager.allocate_slots(seq, n)
            while copies is None and (victim := self._pick_victim(unit, units)) is not None:
                self._preempt(victim, out)
                copies = self.kv_manager.allocate_slots(seq, n)
            if copies is None:  # take what fits; the older ones go on
                n = self.kv_manager.max_fitting_tokens(seq, n)
                copies = self.kv_manager.allocate_slots(seq, n) if n else None
            if copies is not None:
                self._add(seq, n, copies, out)
            if self._budget <= 0:
                return

    def _fit_proposals(self, todo: list[Request]) -> None:
        """Proposals ride on a decode when the token budget has room after the unit's decodes
        (the decodes of older units came first); what does not fit is dropped."""
        spare = self._budget - self._decodes_left
        self._decodes_left -= len(todo)
        for seq in todo:
            if seq.spec_token_ids:
                seq.spec_token_ids = seq.spec_token_ids[:max(0, spare)]
                spare -= len(seq.spec_token_ids)

    def _swap_in_and_admit(self, out: SchedulerOutput) -> None:
        lora = self.lora_admission  # distinct adapters of running sequences <= max_loras
        if lora is not None:
            lora.start_step(self.running)
        # swapped sequences come back before waiting ones
        while self.swapped and self._budget > 0:
            seq = self.swapped[0]
            n = min(seq.num_tokens_to_compute, self._budget)
            if (self.num_running_seqs + seq.num_seqs > self.max_num_seqs
                    or (lora is not None and not lora.try_admit(seq))
                    or not self.swapper.try_swap_in(seq, n, out)):
                break
            self.swapped.popleft()
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            self._add(seq, n, self.kv_manager.allocate_slots(seq, n), out)
        # waiting sequences, first come first served; admission never preempts
        compiling = []  # structured output: sequences whose grammar is still compiling
        skipped = []    # LoRA: their adapter would exceed max_loras this step
        while not self.swapped and self.waiting and self._budget > 0:
            seq = self.waiting[0]
            if seq.structured is not None and not seq.structured.ready:
                compiling.append(self.waiting.popleft())  # let the others go past
                continue
            if lora is not None and not lora.try_admit(seq):
                skipped.append(self.waiting.popleft())  # no adapter slot: keeps its place
                continue
            if self.num_running_seqs + seq.num_seqs > self.max_num_seqs:
                break
            computed, num_computed = self.kv_manager.get_computed_blocks(seq)
            n = min(seq.num_tokens - num_computed, self._budget)
            copies = self.kv_manager.allocate_slots(seq, n, computed)
            if copies is None:
                break
            self.waiting.popleft()
            self.kv_manager.record_prefix_lookup(seq.num_tokens, num_computed)
            seq.start_running(num_computed)
            self.running.append(seq)
            self._add(seq, n, copies, out)
        if compiling or skipped:  # back in their places (fcfs: in front, by arrival)
            for seq in reversed(self.policy.arrival_order(compiling + skipped)):
                self.policy.requeue(self.waiting, seq)
        self._num_compiling = len(compiling)

    def _add(self, seq: Request, n: int, copies: list[tuple[int, int]],
             out: SchedulerOutput) -> None:
        out.requests.append(seq)
        out.num_new_tokens.append(n)
        out.block_copies.extend(copies)
        self._scheduled.add(seq.request_id)
        self._budget -= n

    def _running_units(self) -> list[list[Request]]:
        """Running sequences grouped into units, ordered by their oldest member."""
        units: dict[int, list[Request]] = {}
        for seq in self.running:
            units.setdefault(id(seq.beam_group or seq), []).append(seq)
        return self.policy.order_units(list(units.values()))  # priority: most urgent first

    def _pick_victim(self, unit: list[Request], units: list[list[Request]]) -> list | None:
        """The youngest running unit admitted after `unit` that has nothing in this step."""
        for victim in reversed(units):
            if victim is unit:
                return None
            if victim[0].status == RequestStatus.RUNNING and not any(
                    s.request_id in self._scheduled for s in victim):
                return victim
        return None

    def _preempt(self, unit: list[Request], out: SchedulerOutput) -> None:
        # A beam group always recomputes: swapping its beams one by one would un-share the
        # blocks they hold together, and it could not come back in the room it left.
        swap = self.swapper is not None and unit[0].beam_group is None
        for seq in reversed(unit):  # reversed: the unit keeps its order at the queue's front
            self.running.remove(seq)
            seq.num_preemptions += 1
            out.preempted.append(seq)
            kind = "swap" if swap and self.swapper.try_swap_out(seq, out) else "recompute"
            if kind == "swap":
                seq.status = RequestStatus.SWAPPED
                self.swapped.append(seq)
            else:
                self.kv_manager.free(seq)
                seq.num_computed_tokens = 0
                seq.status = RequestStatus.WAITING
                self.policy.requeue(self.waiting, seq)
            self.num_preemptions[kind] += 1
            logger.debug("preempted %s by %s", seq.request_id, kind)

    def _crosses_rope_switch(self, seq: Request) -> bool:
        return seq.num_tokens == self.rope_switch_length and not seq.long_rope

    def _recompute_for_rope(self, unit: list[Request], out: SchedulerOutput) -> None:
        """The unit's K/V were rotated with the short table: recompute them all with the long
        one (from the waiting queue's front, as a recompute preemption does)."""
        for seq in reversed(unit):
            self.running.remove(seq)
            self.kv_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.block_hashes = []
            seq.long_rope = True
            seq.status = RequestStatus.WAITING
            self.policy.requeue(self.waiting, seq)
            out.preempted.append(seq)
            logger.debug("%s crossed the long-rope switch: recomputing its K/V", seq.request_id)

    def _fail_stuck(self, out: SchedulerOutput, stuck: list[Request]) -> None:
        """Liveness guard. Nothing could run, swap or be preempted (or a unit alone in the
        cache cannot grow), and schedule() depends only on this state, so every later step
        would do the same: fail the stuck sequences with a clear error instead of spinning."""
        kv = self.kv_manager
        out.stuck_reason = (
            f"no sequence can make progress: {kv.num_used_blocks} of {kv.num_blocks} KV blocks "
            f"({kv.block_size} tokens each) are in use by {len(self.running)} running "
            "sequences and none can grow or be admitted; the KV cache is too small for this "
            "workload (raise kv_cache_memory)")
        logger.error("%s", out.stuck_reason)
        out.stuck.extend(stuck)
        for seq in stuck:
            self.finish(seq, RequestStatus.FINISHED_ERROR)

    # --- after the forward -----------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, fork n>1 siblings, apply token
        stops. A sequence that verified proposals gets a list: the accepted ones and the
        token drawn after them; its computed count grows by them (its known token and the
        accepted proposals), tokens after a stop are dropped, and the rejected proposals'
        slots are given back. Returns the sequences that got new tokens (finished ones
        included); a beam's token is left to its beam group to choose."""
        self.kv_manager.step_done()
        updated = []
        for seq, n in zip(out.requests, out.num_new_tokens):
            if seq.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if seq.request_id in out.spec_token_ids:
                self._accept(seq, sampled[seq.request_id])
                updated.append(seq)
                continue
            seq.num_computed_tokens += n
            if seq.request_id not in sampled:
                continue  # a prefill chunk that does not reach the end of the prompt
            if seq.beam_group is not None:
                updated.append(seq)
                continue
            siblings = out.forks.get(seq.request_id, ())
            for sibling in reversed(siblings):  # each lands right after seq: keep their order
                self.fork(seq, sibling)
            seq.pending_siblings = []
            for s in (seq, *siblings):
                s.append_token(sampled[s.request_id])
                updated.append(s)
                status = s.check_stop()
                if status is not None:
                    self.finish(s, status)
        return updated

    def _accept(self, seq: Request, tokens: list[int] | int) -> None:
        if isinstance(tokens, int):  # its proposals were all cut (a grammar): a plain decode
            tokens = [tokens]
        seq.num_computed_tokens += len(tokens)  # its known token, then the accepted proposals
        seq.spec_token_ids = []
        for token in tokens:
            seq.append_token(token)
            status = seq.check_stop()
            if status is not None:
                self.finish(seq, status)
                return
        self.kv_manager.trim(seq)

    def step_failed(self, out: SchedulerOutput) -> None:
        self.kv_manager.step_failed()

    def drop_from_step(self, out: SchedulerOutput, seqs: list[Request]) -> None:
        """These scheduled sequences leave the step before its forward (their LoRA adapter
        could not be put in a slot): out of `out`, finished with an error, their blocks
        given back and any they registered in the prefix cache this step forgotten. The
        rest of the step runs as scheduled."""
        gone = {s.request_id for s in seqs}
        keep = [i for i, s in enumerate(out.requests) if s.request_id not in gone]
        out.requests = [out.requests[i] for i in keep]
        out.num_new_tokens = [out.num_new_tokens[i] for i in keep]
        out.block_tables = [out.block_tables[i] for i in keep]
        for rid in gone:
            out.forks.pop(rid, None)
        for seq in seqs:
            self.finish(seq, RequestStatus.FINISHED_ERROR)
        self.kv_manager.step_dropped()
