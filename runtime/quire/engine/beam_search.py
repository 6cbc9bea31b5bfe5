"""Beam search on the fork / copy-on-write machinery.

Each live beam is a Request. Every step, each beam's top-2W next tokens (by log-probability)
become candidates; the best W that don't end in EOS go on. A beam chosen more than once is
forked (its blocks shared, copied on write); a beam not chosen is finished and frees what
only it held. Candidates ranked within the top W that end in EOS become finished hypotheses,
as in transformers' beam search.
"""

from __future__ import annotations

from dataclasses import dataclass

from quire.engine.request import Request, RequestStatus
from quire.outputs import CompletionOutput, RequestOutput

MAX_BEAM_WIDTH = 10  # 2 x width candidates per beam come from the top-20 logprobs


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    guided_decoding: object = None  # a GuidedDecodingParams: every beam follows the grammar

    def __post_init__(self) -> None:
        w = self.beam_width
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {w!r}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {m!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or lp != lp:
            raise ValueError(f"length_penalty must be a number, got {lp!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        from quire.structured import GuidedDecodingParams
        if self.guided_decoding is not None and not isinstance(self.guided_decoding,
                                                               GuidedDecodingParams):
            raise ValueError(f"guided_decoding must be a GuidedDecodingParams, "
                             f"got {self.guided_decoding!r}")


@dataclass
class _Hypothesis:
    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str


class BeamSearchGroup:
    def __init__(self, request_id: str, prompt: str | None, root: Request,
                 params: BeamSearchParams, eos_token_ids: frozenset[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.eos = frozenset() if params.ignore_eos else eos_token_ids
        self.live: list[Request] = [root]
        self.cum: dict[str, float] = {root.request_id: 0.0}
        self.pending: dict[str, tuple] = {}   # beam id -> this step's logprobs
        self.done: list[_Hypothesis] = []
        self.root = root
        self._next_id = 1

    @property
    def finished(self) -> bool:
        return not self.live

    def add_logprobs(self, beam: Request, logprobs: tuple) -> None:
        self.pending[beam.request_id] = logprobs

    def ready(self) -> bool:
        return bool(self.live) and all(b.request_id in self.pending for b in self.live)

    def advance(self, fork, finish) -> None:
        """One beam step. `fork(parent, new_id)` makes a sibling sharing the parent's blocks;
        `finish(beam, status)` ends a beam and frees its blocks."""
        w = self.params.beam_width
        cands = []
        for order, beam in enumerate(self.live):
            _, _, top_ids, top_lps = self.pending[beam.request_id]
            base = self.cum[beam.request_id]
            cands += [(base + lp, order, rank, beam, t)
                      for rank, (t, lp) in enumerate(zip(top_ids, top_lps))
                      if lp != float("-inf")]  # masked out by the beam's grammar
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
        self.pending.clear()
        used: set[str] = set()
        assigned = []
        for beam, token, score in chosen:  # fork before any parent takes its new token
            if beam.request_id in used:
                beam = fork(beam, f"{self.request_id}#beam{self._next_id}")
                self._next_id += 1
            used.add(beam.request_id)
            assigned.append((beam, token, score))
        for beam in self.live:
            if beam.request_id not in used:
                finish(beam, RequestStatus.FINISHED_ABORTED)  # pruned: frees its own blocks
                self.cum.pop(beam.request_id, None)
        self.live = []
        for beam, token, score in assigned:
            beam.append_token(token)
            self.cum[beam.request_id] = score
            self.live.append(beam)
        if self.live and self.live[0].num_output_tokens >= self.params.max_tokens:
            for beam in self.live:
                self._keep(beam.output_token_ids, self.cum[beam.request_id], "length")
                finish(beam, RequestStatus.FINISHED_LENGTH)
            self.live = []

    def _keep(self, tokens: list[int], cum: float, reason: str) -> None:
        score = cum / (len(tokens) ** self.params.length_penalty)
        self.done.append(_Hypothesis(tokens, cum, score, reason))

    def abort(self, finish) -> None:
        for beam in self.live:
            finish(beam, RequestStatus.FINISHED_ABORTED)
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
            metrics=self.root.metrics, num_cached_tokens=max(self.root.num_cached_tokens, 0))
