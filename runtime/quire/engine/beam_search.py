"""Beam search on the fork / copy-on-write machinery.

Each live beam is a Request. Every step, each beam's top-2W next tokens (by log-probability)
become candidates; the best W that don't end in EOS go on. A beam chosen more than once is
forked (its blocks shared, copied on write); a beam not chosen is finished and frees what
only it held. Candidates ranked within the top W that end in EOS become finished hypotheses,
as in transformers' beam search.

The live beams of one search are its *beam group*: they advance in lockstep (the group picks
every beam's next token once all have reported), so the scheduler runs and preempts them as a
unit (their `lockstep_group` is the search's id). Forks and finishes go through the
scheduler's public methods; the BeamSearch feature (engine/features/beam_search.py) keeps
the groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quire.engine.request import Request, RequestStatus
from quire.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from quire.validation import QuireValidationError, check_int, check_number

MAX_BEAM_WIDTH = 10  # 2 x width candidates per beam come from the top-20 logprobs


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    guided_decoding: object = None  # a GuidedDecodingParams: every beam follows the grammar

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, lo=1, hi=MAX_BEAM_WIDTH)
        check_int("max_tokens", self.max_tokens, lo=1, what="a positive integer")
        check_number("length_penalty", self.length_penalty, lo=-math.inf, hi=None,
                     what="a finite number")
        if not isinstance(self.ignore_eos, bool):
            raise QuireValidationError(
                "ignore_eos", f"ignore_eos must be a boolean, got {self.ignore_eos!r}",
                self.ignore_eos)
        from quire.structured import GuidedDecodingParams
        if self.guided_decoding is not None and not isinstance(self.guided_decoding,
                                                               GuidedDecodingParams):
            raise QuireValidationError("guided_decoding",
                                       f"guided_decoding must be a GuidedDecodingParams, "
                                       f"got {self.guided_decoding!r}", self.guided_decoding)


def num_blocks_for_beam_search(prompt_len: int, params: BeamSearchParams,
                               block_size: int) -> int:
    """The most KV blocks one beam search can hold at once: the prompt's full blocks, shared
    by every beam, plus each beam's own tail (from the prompt's partial block on). The last
    token is never computed: the search ends as soon as it is chosen."""
    shared = prompt_len // block_size
    longest = prompt_len + params.max_tokens - 1
    return shared + params.beam_width * (-(-longest // block_size) - shared)


@dataclass
class _Hypothesis:
    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str


class BeamSearchGroup:
    def __init__(self, request_id: str, prompt: str | None, root: Request,
                 params: BeamSearchParams, eos_token_ids: frozenset[int],
                 on_fork=None) -> None:
        """`on_fork(parent, child)`: a new beam (a grammar copies its parent's state)."""
        self.request_id = request_id  # the client request's id
        self.prompt = prompt
        self.params = params
        self.eos = frozenset() if params.ignore_eos else eos_token_ids
        self.live: list[Request] = [root]
        self.cum: dict[str, float] = {root.request_id: 0.0}
        self.reported: dict[str, TokenLogprobs] = {}  # beam id -> this round's logprobs
        self.done: list[_Hypothesis] = []
        self.root = root
        self.error: str | None = None
        self._next_id = 1
        self.on_fork = on_fork

    @property
    def finished(self) -> bool:
        return not self.live

    def report(self, beam: Request, logprobs: TokenLogprobs) -> None:
        self.reported[beam.request_id] = logprobs

    def ready(self) -> bool:
        """Every live beam has computed all its tokens and reported this round's logprobs
        (a beam recomputing after preemption may hold a stale report: it must report again)."""
        return bool(self.live) and all(
            b.request_id in self.reported and b.num_tokens_to_compute == 0 for b in self.live)

    def advance(self, scheduler) -> None:
        """One beam step: forks through `scheduler.fork`, pruned beams through
        `scheduler.finish` (which frees what only they held)."""
        w = self.params.beam_width
        cands = []
        for order, beam in enumerate(self.live):
            lp = self.reported[beam.request_id]
            base = self.cum[beam.request_id]
            cands += [(base + logprob, order, rank, beam, t)
                      for rank, (t, logprob) in enumerate(zip(lp.top_ids, lp.top_logprobs))
                      if logprob != float("-inf")]  # masked out by the beam's grammar
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen: list[tuple[Request, int, float]] = []
        for i, (score, _, _, beam, token) in enumerate(cands[: 2 * w]):
            if token in self.eos:
                if i < w:
                    self._keep(beam.output_token_ids + [token], score, "stop")
                continue
            chosen.append((beam, token, score))
            if len(chosen) == w:
                break
        self.reported.clear()
        used: set[str] = set()
        assigned = []
        for beam, token, score in chosen:  # fork before any parent takes its new token
            if beam.request_id in used:
                beam = self._fork(beam, scheduler)
            used.add(beam.request_id)
            assigned.append((beam, token, score))
        for beam in self.live:
            if beam.request_id not in used:
                scheduler.finish(beam, RequestStatus.FINISHED_ABORTED)  # pruned
                self.cum.pop(beam.request_id, None)
        self.live = []
        for beam, token, score in assigned:
            beam.append_token(token)
            self.cum[beam.request_id] = score
            self.live.append(beam)
        if self.live and self.live[0].num_output_tokens >= self.params.max_tokens:
            for beam in self.live:
                self._keep(beam.output_token_ids, self.cum[beam.request_id], "length")
                scheduler.finish(beam, RequestStatus.FINISHED_LENGTH)
            self.live = []

    def _fork(self, parent: Request, scheduler) -> Request:
        child = Request(f"{self.request_id}#beam{self._next_id}", parent.prompt_token_ids,
                        parent.sampling_params, frozenset(), parent.max_tokens,
                        parent.metrics.arrival_time, client_request_id=self.request_id,
                        lora=parent.lora, cache_salt=parent.cache_salt,
                        lockstep_group=self.request_id, priority=parent.priority)
        self._next_id += 1
        child.token_ids = list(parent.token_ids)
        child.long_rope = parent.long_rope  # the same chain keys
        if self.on_fork is not None:  # guided: the beam gets its own grammar state
            self.on_fork(parent, child)
        scheduler.fork(parent, child)
        return child

    def _keep(self, tokens: list[int], cum: float, reason: str) -> None:
        score = cum / (len(tokens) ** self.params.length_penalty)
        self.done.append(_Hypothesis(tokens, cum, score, reason))

    def abort(self, scheduler, error: str | None = None) -> None:
        """End every live beam (aborted, or failed with `error`)."""
        status = RequestStatus.FINISHED_ABORTED if error is None else RequestStatus.FINISHED_ERROR
        self.error = self.error or error
        for beam in self.live:
            scheduler.finish(beam, status)
        self.live = []

    def output(self, tokenizer) -> RequestOutput:
        best = sorted(self.done, key=lambda h: -h.score)[: self.params.beam_width]
        completions = [CompletionOutput(
            index=i, text=tokenizer.decode([t for t in h.token_ids if t not in self.eos],
                                           skip_special_tokens=True),
            token_ids=h.token_ids, cumulative_logprob=h.cumulative_logprob,
            finish_reason=h.finish_reason) for i, h in enumerate(best)]
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.root.prompt_token_ids, outputs=completions, finished=True,
            metrics=self.root.metrics, num_cached_tokens=max(self.root.num_cached_tokens, 0),
            error=self.error)
