"""Continuous batching: which sequences run this step, and how many tokens each computes.

One token budget per step covers decodes and prefill chunks alike. Order of service: running
decodes, then running prefills (chunked), then swapped sequences, then waiting ones (FCFS).
A beam group is scheduled and preempted as a *unit* (its live beams advance in lockstep, so
they run together or not at all); any other sequence is a unit of its own. When blocks run
out, the most recently admitted unit is preempted (a lone sequence by swap when the host pool
has room, else by recompute) so the older ones always make progress.

The scheduler owns the per-request features (engine/features/: structured output,
speculation, LoRA slots, beam search) and calls each hook at its one place in the step.

A family whose image runs attend both ways (Gemma 3, `whole_image_runs`) never has a prefill
chunk end inside an image's placeholder run: the chunk ends before the run instead, and waits
for a step with room for all of it (vLLM's disable_chunked_mm_input). The engine refuses a
request with a run longer than the step's token budget, so a run always fits an empty step.

Public interface (the only way to add, fork or finish sequences):
    add_request(seq, siblings)       queue a new sequence (its n>1 siblings ride along)
    schedule() -> SchedulerOutput    one step as plain data: batch, preemptions, swaps,
                                     copies, the features' parts; what can never progress is
                                     failed (out.failed), not spun on
    update(out, result) -> [seq]     after the forward: counts, tokens (several where
                                     proposals were accepted), n>1 forks, token stops; the
                                     features see the sampled tokens (beams take theirs)
    after_output(seqs)               the text is done: the features advance (grammars)
    fork(parent, child)              a new running sibling sharing the parent's blocks
    finish(seq, status)              out of every queue, its blocks given back
    step_failed(out)                 the forward raised: forget the blocks cached this step
    has_unfinished(), num_running_seqs, num_preemptions; running / waiting / swapped (read)
"""

from __future__ import annotations

import logging
from collections import deque

from quire.engine.batch_builder import build_step_batch
from quire.engine.features.base import Feature
from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.request import Request, RequestStatus
from quire.engine.sched_policy import make_queue_policy
from quire.engine.scheduler_output import SchedulerOutput
from quire.engine.step_plan import StepPlan
from quire.multimodal.image_attention import fit_chunk

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, swapper=None,
                 rope_switch_length: int | None = None,
                 features: list[Feature] = (),
                 scheduling_policy: str = "fcfs", whole_image_runs: bool = False) -> None:
        self.kv_manager = kv_manager
        self.whole_image_runs = whole_image_runs  # chunks never end inside an image's run
        # fcfs or priority: queue order, service order, priority preemption (sched_policy.py)
        self.policy = make_queue_policy(scheduling_policy)
        # LongRoPE (Phi-3): a sequence of this many tokens or more rotates with the long table,
        # shorter ones with the short table, and transformers recomputes a sequence's K/V when
        # it grows across the switch. So does this scheduler (by recompute), and the two
        # tables' blocks never share the prefix cache (their hash chains are salted apart).
        self.rope_switch_length = rope_switch_length
        self.features = list(features)  # each hook is called in this order
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.swapper = swapper  # a SwapManager when preemption_mode == 'swap'
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.swapped: deque[Request] = deque()
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.requests: dict[str, Request] = {}  # every live sequence, by id
        self._finished_ids: list[str] = []  # ended since the last step (the executor forgets)
        self._proposals: dict[str, list[int]] = {}  # this step's, per running decode

    # --- queues ----------------------------------------------------------------------------
    def add_request(self, seq: Request, siblings: list[Request] = ()) -> None:
        """`siblings`: the other n > 1 samples, forked from it when its prompt is done."""
        seq.pending_siblings = list(siblings)
        for f in self.features:
            f.added(seq)
        for s in (seq, *seq.pending_siblings):
            self.requests[s.request_id] = s
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
        self.requests[child.request_id] = child
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
        for s in ended:
            self.requests.pop(s.request_id, None)
            self._finished_ids.append(s.request_id)
        for f in self.features:
            f.finished(ended)

    # --- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = StepPlan()
        for f in self.features:  # failures found since the last step
            for seq, why in f.poll():
                out.failed.append((seq.client_request_id, why))
        self._proposals = {}
        for f in self.features:  # tokens to verify after each running decode
            self._proposals.update(f.propose(self.running))
        self.policy.preempt_for_waiting(self, out)  # priority: room for urgent waiters
        self._budget = self.max_num_batched_tokens
        self._scheduled: set[str] = set()
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
        for seq, n in zip(out.requests, out.num_new_tokens):
            out.block_tables.append(self.kv_manager.block_ids(seq))
            if seq.pending_siblings and seq.num_computed_tokens + n == seq.num_tokens:
                out.forks[seq.request_id] = list(seq.pending_siblings)
        # (a sequence waiting for its grammar to compile is not stuck: it will come)
        if (not out.requests and not out.swap_out and not out.preempted
                and not self._num_waiting_for_features and self.has_unfinished()):
            self._fail_stuck(out, [*self.running, *self.swapped, *self.waiting])
        for f in self.features:  # preempted sequences left their blocks
            if out.preempted:
                f.preempted(out.preempted)
        if out.requests:
            self._features_after_schedule(out)
        if not out.requests and not out.swap_out and not out.swap_in:
            for f in self.features:  # nothing runs until a grammar compiles: don't spin
                if f.waiting():
                    f.wait(0.05)
                    break
        return self._output(out)

    def _features_after_schedule(self, out: StepPlan) -> None:
        """The step's sequences are chosen: each feature does its part (draft proposals,
        adapter slots); a sequence a feature can't serve leaves the step and fails alone."""
        for f in self.features:
            failed = f.after_schedule(out, self.running)
            if not failed:
                continue
            dropped = [s for s in out.requests if s.request_id in failed]
            out.drop({s.request_id for s in dropped})
            for seq in dropped:
                out.failed.append((seq.client_request_id, failed[seq.request_id]))
                self.finish(seq, RequestStatus.FINISHED_ERROR)
            self.kv_manager.step_dropped()

    def _output(self, plan: StepPlan) -> SchedulerOutput:
        batch, rows, chunk_seq_ids = build_step_batch(plan, self._masks, self._has_grammar)
        batch.swap_out, batch.swap_in = plan.swap_out, plan.swap_in
        batch.lora_keys_in_use = plan.lora_keys_in_use
        if plan.requests:  # KV tiers: hits to load before the forward, blocks to copy out
            batch.kv_load, batch.kv_store = self.kv_manager.take_tier_moves()
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            batch=batch, seq_ids=[s.request_id for s in plan.requests],
            chunk_seq_ids=chunk_seq_ids,
            num_new_tokens=list(plan.num_new_tokens),
            row_seq_ids=[r.request_id for r in rows],
            forks={p: [s.request_id for s in sibs] for p, sibs in plan.forks.items()},
            spec_token_ids={k: list(v) for k, v in plan.spec_token_ids.items()},
            preempted_ids=[s.request_id for s in plan.preempted], finished_ids=finished,
            failed=plan.failed)

    def _masks(self, rows, groups):
        for f in self.features:
            masks = f.sampling_masks(rows, groups)
            if masks is not None:
                return masks
        return None

    def _has_grammar(self, seq_id: str) -> bool:
        return any(f.decides_eos(seq_id) for f in self.features)

    def _serve(self, unit: list[Request], units: list[list[Request]], decoding: bool,
               out: StepPlan) -> None:
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
            proposals = self._proposals
            while self.kv_manager.num_blocks_to_grow(
                    todo, [1 + len(proposals.get(s.request_id, ())) for s in todo]) \
                    > self.kv_manager.num_free_blocks:
                if any(proposals.get(s.request_id) for s in todo):  # they go before anyone
                    for s in todo:
                        proposals.pop(s.request_id, None)
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
                k = len(proposals.get(seq.request_id, ()))
                self._add(seq, 1 + k, self.kv_manager.allocate_slots(seq, 1, num_lookahead=k),
                          out)
                if k:
                    out.spec_token_ids[seq.request_id] = proposals[seq.request_id]
            return
        for seq in todo:  # prefills: a chunk each, as budget and blocks allow
            n = self._fit(seq, seq.num_computed_tokens,
                          min(seq.num_tokens_to_compute, self._budget))
            if not n:  # the next image's run needs more budget than is left: next step
                continue
            copies = self.kv_manager.allocate_slots(seq, n)
            while copies is None and (victim := self._pick_victim(unit, units)) is not None:
                self._preempt(victim, out)
                copies = self.kv_manager.allocate_slots(seq, n)
            if copies is None:  # take what fits; the older ones go on
                n = self._fit(seq, seq.num_computed_tokens,
                              self.kv_manager.max_fitting_tokens(seq, n))
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
            proposals = self._proposals.get(seq.request_id)
            if proposals:
                del proposals[max(0, spare):]  # in place: a draft fills the same list
                spare -= len(proposals)

    def _swap_in_and_admit(self, out: StepPlan) -> None:
        for f in self.features:  # e.g. LoRA: which adapters the running sequences hold
            f.start_admission(self.running)
        # swapped sequences come back before waiting ones
        while self.swapped and self._budget > 0:
            seq = self.swapped[0]
            n = self._fit(seq, seq.num_computed_tokens,
                          min(seq.num_tokens_to_compute, self._budget))
            if (not n or self.num_running_seqs + seq.num_seqs > self.max_num_seqs
                    or not self._features_admit(seq)
                    or not self.swapper.try_swap_in(seq, n, out)):
                break
            self.swapped.popleft()
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            self._add(seq, n, self.kv_manager.allocate_slots(seq, n), out)
        # waiting sequences, first come first served; admission never preempts. A sequence a
        # feature holds back (its grammar compiling, its adapter one too many) lets the
        # others go past and keeps its place.
        held = []
        while not self.swapped and self.waiting and self._budget > 0:
            seq = self.waiting[0]
            if not self._features_admit(seq):
                held.append(self.waiting.popleft())
                continue
            if self.num_running_seqs + seq.num_seqs > self.max_num_seqs:
                break
            computed, num_computed = self.kv_manager.get_computed_blocks(seq)
            n = self._fit(seq, num_computed, min(seq.num_tokens - num_computed, self._budget))
            if not n:  # its first image's run doesn't fit what is left of the budget
                break
            copies = self.kv_manager.allocate_slots(seq, n, computed)
            if copies is None:
                break
            self.waiting.popleft()
            self.kv_manager.record_prefix_lookup(seq.num_tokens, num_computed)
            seq.start_running(num_computed)
            self.running.append(seq)
            self._add(seq, n, copies, out)
        if held:  # back in their places (fcfs: in front, by arrival)
            for seq in reversed(self.policy.arrival_order(held)):
                self.policy.requeue(self.waiting, seq)

    def _fit(self, seq: Request, start: int, n: int) -> int:
        """The chunk of n tokens from `start`, cut to end before an image's run it would end
        inside (whole_image_runs); 0 when it would start inside one that it can't finish."""
        if not self.whole_image_runs or not seq.images:
            return n
        return fit_chunk(seq.images, start, n)

    def _features_admit(self, seq: Request) -> bool:
        return all(f.may_admit(seq) for f in self.features)

    def runnable(self, seq: Request) -> bool:
        """No feature holds it back for good reason now (its grammar is compiled); asks
        without taking anything (a LoRA slot is taken at admission)."""
        return all(f.runnable(seq) for f in self.features)

    @property
    def _num_waiting_for_features(self) -> int:
        """Features with work under way that will make a waiting sequence runnable."""
        return sum(1 for f in self.features if f.waiting())

    def _add(self, seq: Request, n: int, copies: list[tuple[int, int]],
             out: StepPlan) -> None:
        out.requests.append(seq)
        out.num_new_tokens.append(n)
        out.block_copies.extend(copies)
        self._scheduled.add(seq.request_id)
        self._budget -= n

    def _running_units(self) -> list[list[Request]]:
        """Running sequences grouped into units, ordered by their oldest member."""
        units: dict[int, list[Request]] = {}
        for seq in self.running:
            units.setdefault(seq.lockstep_group or seq.request_id, []).append(seq)
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

    def _preempt(self, unit: list[Request], out: StepPlan) -> None:
        # A beam group always recomputes: swapping its beams one by one would un-share the
        # blocks they hold together, and it could not come back in the room it left.
        swap = self.swapper is not None and unit[0].lockstep_group is None
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

    def _recompute_for_rope(self, unit: list[Request], out: StepPlan) -> None:
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

    def _fail_stuck(self, out: StepPlan, stuck: list[Request]) -> None:
        """Liveness guard. Nothing could run, swap or be preempted (or a unit alone in the
        cache cannot grow), and schedule() depends only on this state, so every later step
        would do the same: fail the stuck sequences with a clear error instead of spinning."""
        kv = self.kv_manager
        reason = (
            f"no sequence can make progress: {kv.num_used_blocks} of {kv.num_blocks} KV blocks "
            f"({kv.block_size} tokens each) are in use by {len(self.running)} running "
            "sequences and none can grow or be admitted; the KV cache is too small for this "
            "workload (raise kv_cache_memory)")
        logger.error("%s", reason)
        for seq in stuck:
            out.failed.append((seq.client_request_id, reason))
            self.finish(seq, RequestStatus.FINISHED_ERROR)

    # --- after the forward -----------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int | list[int]],
               logprobs: dict) -> list[Request]:
        """Advance computed counts, append sampled tokens, fork n>1 siblings, apply token
        stops. A sequence that verified proposals gets a list: the accepted ones and the
        token drawn after them; its computed count grows by them (its known token and the
        accepted proposals), tokens after a stop are dropped, and the rejected proposals'
        slots are given back. Then the features see the sampled tokens (a beam search takes
        its beams' and chooses their tokens). Returns the other sequences that got new
        tokens (finished ones included)."""
        self.kv_manager.step_done()
        updated = []
        for rid, n in zip(out.seq_ids, out.num_new_tokens):
            seq = self.requests.get(rid)
            if seq is None or seq.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if rid in out.spec_token_ids:
                self._accept(seq, sampled[rid])
                updated.append(seq)
                continue
            seq.num_computed_tokens += n
            if rid not in sampled:
                continue  # a prefill chunk that does not reach the end of the prompt
            if seq.lockstep_group is not None:  # its beam group chooses its token
                updated.append(seq)
                continue
            siblings = [self.requests[s] for s in out.forks.get(rid, ())]
            for sibling in reversed(siblings):  # each lands right after seq: keep their order
                self.fork(seq, sibling)
            seq.pending_siblings = []
            for s in (seq, *siblings):
                s.append_token(sampled[s.request_id])
                updated.append(s)
                status = s.check_stop()
                if status is not None:
                    self.finish(s, status)
        for f in self.features:
            updated = f.sampled(updated, out, sampled, logprobs, self)
        return updated

    def after_output(self, seqs: list[Request]) -> None:
        """The output processor has their text: features that follow the tokens (grammars)
        take them now, after the text, so a grammar's end keeps the text's."""
        for f in self.features:
            f.updated(seqs, self)

    def end_answer(self, seq: Request, num_output_tokens: int) -> None:
        """A feature (a grammar) ended the answer after this many output tokens: the later
        ones of its step (a verification's) are not part of it, and one that ended this step
        by its EOS or its length ended here instead, as without speculation."""
        past = num_output_tokens < seq.num_output_tokens
        seq.drop_output_tokens_after(num_output_tokens)
        if not seq.finished:
            self.finish(seq, RequestStatus.FINISHED_STOPPED)
        elif past:
            seq.status, seq.stop_reason = RequestStatus.FINISHED_STOPPED, None

    def _accept(self, seq: Request, tokens: list[int] | int) -> None:
        if isinstance(tokens, int):  # its proposals were all cut (a grammar): a plain decode
            tokens = [tokens]
        seq.num_computed_tokens += len(tokens)  # its known token, then the accepted proposals
        for token in tokens:
            seq.append_token(token)
            status = seq.check_stop()
            if status is not None:
                self.finish(seq, status)
                return
        self.kv_manager.trim(seq)

    def step_failed(self, out: SchedulerOutput) -> None:
        self.kv_manager.step_failed()

    def sequence(self, seq_id: str) -> Request | None:
        """A live sequence by id."""
        return self.requests.get(seq_id)
