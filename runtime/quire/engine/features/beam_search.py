"""Beam search as a scheduler feature: it keeps the beam groups (by the search's id, which
is every beam's `lockstep_group`), takes its beams' sampled logprobs after each step and,
once a group's beams have all reported, chooses their tokens (engine/beam_search.py)."""

from __future__ import annotations

from quire.engine.beam_search import BeamSearchGroup
from quire.engine.features.base import Feature


class BeamSearch(Feature):
    def __init__(self, structured=None) -> None:
        self.groups: dict[str, BeamSearchGroup] = {}  # search id -> its group
        self.structured = structured  # the StructuredOutput feature: beams follow grammars
        self._finished: list[BeamSearchGroup] = []  # groups that ended, for their outputs

    def add(self, group: BeamSearchGroup) -> None:
        self.groups[group.request_id] = group

    def sampled(self, seqs, out, sampled, logprobs, scheduler):
        """Each beam's report goes to its group; the groups whose beams all reported choose
        their tokens (and each advanced beam's grammar takes its token). The rest pass on."""
        rest, advancing = [], {}
        for seq in seqs:
            group = self.groups.get(seq.lockstep_group) if seq.lockstep_group else None
            if group is None:
                rest.append(seq)
                continue
            group.report(seq, logprobs[seq.request_id])
            advancing[group.request_id] = group
        for group in advancing.values():
            if group.ready():
                group.advance(scheduler)
                if self.structured is not None:
                    self.structured.advance(group.live)
            if group.finished:
                self._finished.append(self.groups.pop(group.request_id))
        return rest

    def pop_finished(self) -> list[BeamSearchGroup]:
        """Groups that ended since the last call (their outputs are due)."""
        done, self._finished = self._finished, []
        return done

    def end(self, request_id: str, scheduler, error: str | None = None) -> bool:
        """Abort a search (no output), or fail it with `error` (its output carries the
        error); False if there is none by that id."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        group.abort(scheduler, error=error)
        if error is not None:
            self._finished.append(group)
        return True
