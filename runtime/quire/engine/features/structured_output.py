"""Structured output as a scheduler feature: one grammar state per sequence (in `states`,
keyed by sequence id), the batch's bitmask before sampling, and advancing every state by its
accepted tokens.

  attach(seqs, params)   add_request: every sample of the request gets its own matcher
  poll()                 step start: compiled grammars become ready; failures are returned
  may_admit(seq)         a waiting sequence runs only once its grammar is compiled
  sampling_masks(rows)   one int32 bitmask row per sampled row (all ones: no grammar); the
                         sampler applies it first
  updated(seqs, sched)   after the text: each new token advances its matcher; a terminated
                         grammar ends its sequence's answer there (scheduler.end_answer: a
                         verification step's later tokens dropped, even where that step's
                         EOS or length had ended it: its grammar is kept until then)
  fork(parent, child)    beam search: a new beam copies its parent's matcher
  preempted(seqs)        a matcher always matches the tokens its sequence keeps
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

import torch

from quire.engine.features.base import Feature
from quire.engine.request import Request, RequestStatus
from quire.structured.compiler import DEFAULT_CACHE_SIZE, GrammarCompiler
from quire.structured.params import GuidedDecodingParams

logger = logging.getLogger(__name__)


class GrammarState:
    """One sequence's grammar: compiling (future), then a matcher."""

    __slots__ = ("future", "matcher", "num_accepted")

    def __init__(self, future: concurrent.futures.Future | None, matcher=None,
                 num_accepted: int = 0) -> None:
        self.future = future
        self.matcher = matcher
        self.num_accepted = num_accepted  # output tokens the matcher has consumed

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def fork(self) -> GrammarState:
        """A new beam's own copy: the same future, or a copy of the matcher."""
        if self.matcher is None:
            return GrammarState(self.future)
        return GrammarState(None, self.matcher.fork(), self.num_accepted)


class StructuredOutput(Feature):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        from quire.structured.backend import Backend, bitmask_words
        self.vocab_size = vocab_size
        self.words = bitmask_words(max(vocab_size, len(tokenizer)))  # llguidance's width
        self.compiler = GrammarCompiler(
            lambda: Backend(tokenizer, vocab_size, eos_token_ids), cache_size)
        self.states: dict[str, GrammarState] = {}  # sequence id -> its grammar
        # grammars of sequences that ended this step by a token (EOS, stop id) or their
        # length, until their step's tokens have been read (updated): a verification step's
        # tokens may run past the grammar's end, which then ends the answer first
        self._ending: dict[str, GrammarState] = {}
        self._compiling: list[list[Request]] = []  # sibling groups whose grammar is pending
        # metrics, moved into StepEvents by record()
        self.num_requests = 0
        self.mask_seconds: list[float] = []

    # --- requests ------------------------------------------------------------------------
    def attach(self, seqs: list[Request], params: GuidedDecodingParams) -> None:
        future = self.compiler.submit(params)
        for s in seqs:
            self.states[s.request_id] = GrammarState(future)
        self._compiling.append(seqs)
        self.num_requests += 1

    def poll(self) -> list[tuple[Request, str]]:
        """Start the matchers of grammars compiled since the last call. Returns (request,
        error) for each request whose grammar failed to compile: the engine fails them."""
        failed, still = [], []
        for seqs in self._compiling:
            if seqs[0].finished:
                continue  # aborted while compiling
            future = self.states[seqs[0].request_id].future
            if not future.done():
                still.append(seqs)
                continue
            error = future.exception()
            if error is not None:
                failed.append((seqs[0], f"grammar compilation failed: {error}"))
                continue
            for s in seqs:
                state = self.states.get(s.request_id)
                if state is not None:
                    state.matcher = future.result().new_matcher()
                    state.future = None
        self._compiling = still
        return failed

    def wait(self, timeout: float) -> None:
        """Block until a pending grammar compiles (an idle engine need not spin)."""
        futures = [self.states[seqs[0].request_id].future for seqs in self._compiling
                   if seqs[0].request_id in self.states]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def waiting(self) -> bool:
        return bool(self._compiling)

    def may_admit(self, seq: Request) -> bool:
        return self.runnable(seq)

    def runnable(self, seq: Request) -> bool:
        state = self.states.get(seq.request_id)
        return state is None or state.ready

    def decides_eos(self, seq_id: str) -> bool:
        return seq_id in self.states

    def matcher(self, seq_id: str):
        """The sequence's ready matcher, or None (no grammar, or still compiling)."""
        state = self.states.get(seq_id)
        return None if state is None else state.matcher

    def finished(self, seqs) -> None:
        for s in seqs:
            state = self.states.pop(s.request_id, None)
            if state is not None and state.matcher is not None and s.status in (
                    RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) \
                    and state.num_accepted < s.num_output_tokens - 1:
                self._ending[s.request_id] = state

    # --- sampling ------------------------------------------------------------------------
    def sampling_masks(self, rows: list[Request], groups) -> torch.Tensor | None:
        return self.fill_bitmask_ahead(rows, groups) if groups else self.fill_bitmask(rows)

    def fill_bitmask(self, rows: list[Request]) -> torch.Tensor | None:
        """int32 [len(rows), words]: each grammar row's allowed tokens, all ones elsewhere."""
        matchers = [(m, i) for i, r in enumerate(rows)
                    if (m := self.matcher(r.request_id)) is not None]
        if not matchers:
            return None
        t0 = time.perf_counter()
        bitmask = torch.full((len(rows), self.words), -1, dtype=torch.int32)
        self.compiler.backend.fill_bitmask(matchers, bitmask)
        self.mask_seconds.append(time.perf_counter() - t0)
        return bitmask

    def fill_bitmask_ahead(self, rows: list[Request],
                           groups: list[tuple[int, list[int]]]) -> torch.Tensor | None:
        """fill_bitmask, where each group's rows (a sequence verifying proposals) get the
        masks of its positions: the grammar advanced through the proposals before each, then
        rolled back (the proposals are the grammar's, checked by valid_prefix)."""
        in_group = {start + j for start, p in groups for j in range(len(p) + 1)}
        plain = [r if i not in in_group else None for i, r in enumerate(rows)]
        matchers = [(m, i) for i, r in enumerate(plain)
                    if r is not None and (m := self.matcher(r.request_id)) is not None]
        grammar_groups = [(m, start, p) for start, p in groups
                          if (m := self.matcher(rows[start].request_id)) is not None]
        if not matchers and not grammar_groups:
            return None
        t0 = time.perf_counter()
        bitmask = torch.full((len(rows), self.words), -1, dtype=torch.int32)
        if matchers:
            self.compiler.backend.fill_bitmask(matchers, bitmask)
        for matcher, start, proposals in grammar_groups:
            for j in range(len(proposals) + 1):
                self.compiler.backend.fill_bitmask([(matcher, start + j)], bitmask)
                if j < len(proposals) and not matcher.accept(proposals[j]):
                    raise RuntimeError("a proposal the grammar refused reached verification")
            matcher.rollback(len(proposals))
        self.mask_seconds.append(time.perf_counter() - t0)
        return bitmask

    def valid_prefix(self, seq_id: str, proposals: list[int]) -> list[int]:
        """The leading proposals the sequence's grammar allows (all of them without one)."""
        matcher = self.matcher(seq_id)
        if matcher is None or not proposals:
            return proposals
        return proposals[:matcher.valid_prefix_length(proposals)]

    # --- after sampling ------------------------------------------------------------------
    def updated(self, seqs, scheduler) -> None:
        try:
            self.advance([s for s in seqs if s.lockstep_group is None], scheduler)
        finally:
            self._ending.clear()

    def advance(self, seqs: list[Request], scheduler=None) -> None:
        """Each sequence's new tokens (one, or the accepted proposals of a step) enter its
        matcher; the scheduler ends the answer of a sequence whose grammar has terminated
        (nothing but EOS could follow: its step's later tokens are dropped) and fails one
        whose token the grammar refused. Beams pass no scheduler: their group ends them, and
        a terminated grammar's mask leaves only EOS."""
        for seq in seqs:
            state = self.states.get(seq.request_id) or self._ending.get(seq.request_id)
            if state is None or state.matcher is None or state.matcher.is_terminated():
                continue
            while state.num_accepted < seq.num_output_tokens:
                token = seq.token_ids[seq.num_prompt_tokens + state.num_accepted]
                if not state.matcher.accept(token):
                    logger.error("request %s: token %d rejected by its grammar: %s",
                                 seq.request_id, token, state.matcher.error())
                    if scheduler is not None and not seq.finished:
                        scheduler.finish(seq, RequestStatus.FINISHED_ERROR)
                    break
                state.num_accepted += 1
                if scheduler is not None and state.matcher.is_terminated():
                    # the answer ends with the grammar, as without speculation: a
                    # verification step's later tokens (EOS, all the terminated grammar's
                    # mask allows) are not part of it
                    scheduler.end_answer(seq, state.num_accepted)
                    break

    def fork(self, parent: Request, child: Request) -> None:
        """A new beam gets its own copy of its parent's grammar state."""
        state = self.states.get(parent.request_id)
        if state is not None:
            self.states[child.request_id] = state.fork()

    def preempted(self, reqs: list[Request]) -> None:
        """After preemption: the matcher must have consumed exactly the output tokens the
        sequence keeps (recompute keeps them all, so this is a check); otherwise it is reset
        and the kept tokens replayed."""
        for req in reqs:
            state = self.states.get(req.request_id)
            if state is None or state.matcher is None:
                continue
            if state.num_accepted != req.num_output_tokens:
                state.matcher.reset()
                for t in req.output_token_ids:
                    state.matcher.accept(t)
                state.num_accepted = req.num_output_tokens

    # --- metrics -------------------------------------------------------------------------
    def record(self, events) -> None:
        events.structured_requests += self.num_requests
        events.grammar_mask_time.extend(self.mask_seconds)
        self.num_requests, self.mask_seconds = 0, []
