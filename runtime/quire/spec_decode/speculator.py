"""The engine's side of speculative decoding: which sequences propose, how many tokens, what
was accepted.

Each step, before scheduling, every running decode that may speculate gets its proposals
(`seq.spec_token_ids`): n-gram proposals are found at once; a draft model's are placeholders
that it fills after scheduling (spec_decode/draft.py), when the scheduler has given them KV
slots. The scheduler budgets them like any tokens and drops what doesn't fit; the runner scores
them in the step's one forward; the sampler verifies them (spec_decode/rejection.py); the
scheduler's update appends the accepted ones and gives back the rejected ones' slots.

Sequences that never propose: beams (beam search refuses a speculative config), and rows whose
sampling reads the whole output so far at every position (repetition / presence / frequency
penalties) or returns logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quire.spec_decode.config import SpeculativeConfig
from quire.spec_decode.ngram import propose_ngram
from quire.spec_decode.spec_state import SpecState


@dataclass
class SpecCounters:
    """Accumulated between two metric drains."""
    num_drafts: int = 0            # sequences that verified proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, rope_switch_length: int | None = None,
                 draft=None, structured=None) -> None:
        self.config = config
        self.rope_switch_length = rope_switch_length
        self.draft = draft  # a DraftProposer for method draft_model
        self.structured = structured  # the StructuredOutputManager: proposals obey grammars
        self.counters = self._fresh_counters()

    def _fresh_counters(self) -> SpecCounters:
        return SpecCounters(accepted_per_position=[0] * self.config.num_speculative_tokens)

    # --- before scheduling ---------------------------------------------------------------
    def propose(self, running) -> None:
        cfg = self.config
        for seq in running:
            seq.spec_token_ids = []
            k = self._room(seq)
            if k <= 0:
                continue
            if seq.spec is None:
                seq.spec = SpecState(cfg.num_speculative_tokens, cfg.adaptive_window,
                                     cfg.adaptive_min_acceptance)
            k = min(k, seq.spec.proposals_now(not cfg.disable_adaptive))
            if k <= 0:
                continue
            if cfg.method == "ngram":
                proposals = propose_ngram(seq.token_ids, k, cfg.prompt_lookup_min,
                                          cfg.prompt_lookup_max)
                seq.spec_token_ids = self._grammar_allows(seq, proposals)
            else:
                seq.spec_token_ids = [0] * k  # the draft fills them once they have slots

    def _room(self, seq) -> int:
        """How many proposals this sequence may verify now (0: none)."""
        p = seq.sampling_params
        if (seq.num_tokens_to_compute != 1 or seq.beam_group is not None or seq.finished
                or p.logprobs is not None or p.repetition_penalty != 1.0
                or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            return 0
        # the last one is always the target's own token: never propose past max_tokens
        k = min(self.config.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1)
        if self.rope_switch_length and not seq.long_rope:  # it recomputes at the switch: not across
            k = min(k, self.rope_switch_length - seq.num_tokens - 1)
        return k

    # --- after scheduling ----------------------------------------------------------------
    def fill(self, sched) -> None:
        """Draft proposals for the sequences the scheduler gave proposal slots."""
        if self.draft is None:
            return
        self.draft.mirror_copies(sched)  # every step's: a later proposal may read the block
        if not sched.spec_token_ids:
            return
        self.draft.fill(sched)
        for i, seq in enumerate(sched.requests):  # a grammar keeps only what it allows
            proposals = sched.spec_token_ids.get(seq.request_id)
            if proposals and seq.structured is not None:
                del proposals[len(self._grammar_allows(seq, proposals)):]
                sched.num_new_tokens[i] = 1 + len(proposals)

    def _grammar_allows(self, seq, proposals: list[int]) -> list[int]:
        if self.structured is None or seq.structured is None:
            return proposals
        return self.structured.valid_prefix(seq, proposals)

    # --- after verification --------------------------------------------------------------
    def record(self, sched, sampled: dict) -> None:
        c = self.counters
        seq_of = {s.request_id: s for s in sched.requests}
        for rid, proposals in sched.spec_token_ids.items():
            tokens = sampled.get(rid)
            if tokens is None or not proposals:
                continue
            accepted = len(tokens) - 1
            c.num_drafts += 1
            c.num_draft_tokens += len(proposals)
            c.num_accepted_tokens += accepted
            for i in range(accepted):
                c.accepted_per_position[i] += 1
            if seq_of[rid].spec is not None:
                seq_of[rid].spec.record(len(proposals), accepted,
                                        not self.config.disable_adaptive)

    def drain(self) -> SpecCounters:
        c, self.counters = self.counters, self._fresh_counters()
        return c
