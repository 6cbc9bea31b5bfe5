"""Draft-model proposals: a smaller model with the target's vocabulary guesses the next k
tokens greedily; the target verifies them in its step (worker/rejection.py treats a greedy
draft as a point mass, which keeps sampling exact).

The draft model (worker/draft_model.py, owned by the executor) keeps its own KV cache with
the target's block layout: the same block ids and slots (the scheduler's tables), its own
tensors. A sequence's draft KV is valid below its SpecState's `draft_computed`; each proposal
round first feeds the draft what it has not seen (the whole prompt the first time, then the
one or two tokens the last verification committed), then k - 1 one-token steps. Every
position it writes lies inside the slots the scheduler gave the step (the sequence's known
token and its k proposals), so it never touches another sequence's blocks. Copy-on-write
copies are mirrored into the draft's cache; a preempted sequence (its blocks recomputed or
swapped) starts its draft KV over.
"""

from __future__ import annotations

from quire.step_batch import SequenceChunk


class DraftProposer:
    def __init__(self, draft_model) -> None:
        self.model = draft_model  # the executor's DraftModel: greedy(chunks), copy_blocks

    def mirror_copies(self, plan) -> None:
        self.model.copy_blocks(plan.block_copies)

    def fill(self, plan, states) -> None:
        """Write the draft's proposals into the sequences' proposal lists (in place: the
        plan holds the same lists). `states`: sequence id -> SpecState."""
        rows = [(seq, table, plan.spec_token_ids[seq.request_id], states[seq.request_id])
                for seq, table in zip(plan.requests, plan.block_tables)
                if seq.request_id in plan.spec_token_ids]
        for seq, _, _, state in rows:
            if state.draft_preemptions != seq.num_preemptions:  # its blocks are new
                state.draft_computed, state.draft_preemptions = 0, seq.num_preemptions
            state.draft_computed = min(state.draft_computed, seq.num_computed_tokens)
        # round 0: what the draft has not seen, up to the sequence's known last token
        chunks = [SequenceChunk(seq.token_ids[state.draft_computed:], state.draft_computed,
                                seq.num_prompt_tokens, seq.num_tokens, table, 1)
                  for seq, table, _, state in rows]
        guesses = self.model.greedy(chunks)
        for (seq, _, proposals, state), token in zip(rows, guesses):
            proposals[0] = token
            state.draft_computed = seq.num_tokens
        for j in range(1, max(len(p) for _, _, p, _ in rows)):
            live = [row for row in rows if len(row[2]) > j]
            chunks = [SequenceChunk([p[j - 1]], seq.num_tokens - 1 + j, seq.num_prompt_tokens,
                                    seq.num_tokens + j, table, 1) for seq, table, p, _ in live]
            for (seq, _, proposals, state), token in zip(live, self.model.greedy(chunks)):
                proposals[j] = token
                state.draft_computed = seq.num_tokens + j
