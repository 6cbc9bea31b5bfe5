"""The engine's side of speculative decoding: which sequences propose, how many tokens, what
was accepted.

Each step, before scheduling, every running decode that may speculate gets its proposals
(`propose`): n-gram proposals are found at once; a draft model's are placeholders that it
fills after scheduling (`after_schedule`, spec_decode/draft.py), when the scheduler has given
them KV slots. The scheduler budgets them like any tokens and drops what doesn't fit; the runner scores
them in the step's one forward; the sampler verifies them (worker/rejection.py); the
scheduler's update appends the accepted ones and gives back the rejected ones' slots.

Sequences that never propose: beams (beam search refuses a speculative config), and rows whose
sampling reads the whole output so far at every position (repetition / presence / frequency
penalties) or returns logprobs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from quire.engine.features.base import Feature
from quire.spec_decode.ngram import propose_ngram
from quire.spec_decode.spec_state import SpecState
from quire.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass
class SpecCounters:
    """Accumulated between two metric drains."""
    num_drafts: int = 0            # sequences that verified proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculation(Feature):
    def __init__(self, config: SpeculativeConfig, rope_switch_length: int | None = None,
                 draft=None, structured=None) -> None:
        self.config = config
        self.rope_switch_length = rope_switch_length
        self.draft = draft  # a DraftProposer for method draft_model
        self.structured = structured  # the StructuredOutput feature: proposals obey grammars
        self.states: dict[str, SpecState] = {}  # sequence id -> its acceptance record
        self.counters = self._fresh_counters()

    def _fresh_counters(self) -> SpecCounters:
        return SpecCounters(accepted_per_position=[0] * self.config.num_speculative_tokens)

    # --- before scheduling ---------------------------------------------------------------
    def propose(self, running) -> dict[str, list[int]]:
        cfg = self.config
        proposals = {}
        for seq in running:
            k = self._room(seq)
            if k <= 0:
                continue
            state = self.states.get(seq.request_id)
            if state is None:
                state = self.states[seq.request_id] = SpecState(
                    cfg.num_speculative_tokens, cfg.adaptive_window, cfg.adaptive_min_acceptance)
            k = min(k, state.proposals_now(not cfg.disable_adaptive))
            if k <= 0:
                continue
            if cfg.method == "ngram":
                found = propose_ngram(seq.token_ids, k, cfg.prompt_lookup_min,
                                      cfg.prompt_lookup_max)
                found = self._grammar_allows(seq, found)
            else:
                found = [0] * k  # the draft fills them once they have slots
            if found:
                proposals[seq.request_id] = found
        return proposals

    def _room(self, seq) -> int:
        """How many proposals this sequence may verify now (0: none)."""
        p = seq.sampling_params
        if (seq.num_tokens_to_compute != 1 or seq.lockstep_group is not None or seq.finished
                or p.logprobs is not None or p.repetition_penalty != 1.0
                or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            return 0
        # the last one is always the target's own token: never propose past max_tokens
        k = min(self.config.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1)
        if self.rope_switch_length and not seq.long_rope:  # it recomputes at the switch: not across
            k = min(k, self.rope_switch_length - seq.num_tokens - 1)
        return k

    # --- after scheduling ----------------------------------------------------------------
    def after_schedule(self, plan, running) -> dict[str, str]:
        """Draft proposals for the sequences the scheduler gave proposal slots; if the draft
        model fails, the sequences that proposed fail alone."""
        if self.draft is None:
            return {}
        try:
            self.draft.mirror_copies(plan)  # every step's: a later proposal may read the block
            if not plan.spec_token_ids:
                return {}
            self.draft.fill(plan, self.states)
        except Exception as e:
            logger.exception("the draft model failed; failing the sequences that proposed")
            return {rid: f"model step failed: {e}" for rid in plan.spec_token_ids}
        for i, seq in enumerate(plan.requests):  # a grammar keeps only what it allows
            proposals = plan.spec_token_ids.get(seq.request_id)
            if proposals and self._has_grammar(seq):
                del proposals[len(self._grammar_allows(seq, proposals)):]
                plan.num_new_tokens[i] = 1 + len(proposals)
        return {}

    def _has_grammar(self, seq) -> bool:
        return self.structured is not None and self.structured.decides_eos(seq.request_id)

    def _grammar_allows(self, seq, proposals: list[int]) -> list[int]:
        if not self._has_grammar(seq):
            return proposals
        return self.structured.valid_prefix(seq.request_id, proposals)

    # --- after verification --------------------------------------------------------------
    def sampled(self, seqs, out, sampled: dict, logprobs, scheduler):
        c = self.counters
        for rid, proposals in out.spec_token_ids.items():
            tokens = sampled.get(rid)
            if tokens is None or not proposals:
                continue
            accepted = len(tokens) - 1
            c.num_drafts += 1
            c.num_draft_tokens += len(proposals)
            c.num_accepted_tokens += accepted
            for i in range(accepted):
                c.accepted_per_position[i] += 1
            state = self.states.get(rid)
            if state is not None:
                state.record(len(proposals), accepted, not self.config.disable_adaptive)
        return seqs

    def finished(self, seqs) -> None:
        for s in seqs:
            self.states.pop(s.request_id, None)

    def record(self, events) -> None:
        c = self.drain()
        events.spec_drafts, events.spec_draft_tokens = c.num_drafts, c.num_draft_tokens
        events.spec_accepted_tokens = c.num_accepted_tokens
        events.spec_accepted_per_position = c.accepted_per_position

    def drain(self) -> SpecCounters:
        c, self.counters = self.counters, self._fresh_counters()
        return c
