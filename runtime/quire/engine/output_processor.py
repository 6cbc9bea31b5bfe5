"""From sequences with new tokens to RequestOutputs: detokenize, apply stop strings, gather
the n samples of a client request (its sibling group), and emit cumulative, delta or
final-only outputs. Beam searches report through their BeamSearchGroup instead."""

from __future__ import annotations

import logging
import time

from quire.engine.detokenizer import IncrementalDetokenizer
from quire.engine.prompt_logprobs import PromptLogprobs, fill_prompt_logprobs
from quire.engine.request import Request, RequestStatus
from quire.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from quire.sampling_params import RequestOutputKind, SamplingParams
from quire.step_batch import PromptLogprobsResult

logger = logging.getLogger(__name__)


class SiblingGroup:
    """The n sequences a client request became, and what has been sent of each."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seqs: list[Request], tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.detoks = [IncrementalDetokenizer(tokenizer, prompt_token_ids, s.sampling_params)
                       for s in seqs]
        self.sent_text = [0] * len(seqs)
        self.sent_tokens = [0] * len(seqs)
        self.seen_tokens = [0] * len(seqs)  # output tokens detokenized, per sequence
        self.error: str | None = None
        self.prompt_logprobs: PromptLogprobs | None = None  # filled as its prefill runs
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(prompt_token_ids)
        self.sent_prompt_logprobs = False  # (delta outputs carry them once)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, SiblingGroup] = {}  # client request id -> its sibling group
        self._seq_group: dict[str, tuple[SiblingGroup, int]] = {}  # sequence id -> (group, i)

    def add(self, request_id, prompt, prompt_token_ids, params, seqs: list[Request]) -> None:
        group = SiblingGroup(request_id, prompt, prompt_token_ids, params, seqs, self.tokenizer)
        self.groups[request_id] = group
        for i, s in enumerate(seqs):
            self._seq_group[s.request_id] = (group, i)

    def process(self, updated: list[Request], logprobs: dict[str, TokenLogprobs],
                finish) -> set[str]:
        """Detokenize each sequence's new tokens (one per step, or several when proposals
        were accepted), in order; `finish(seq, status)` ends one early (a stop string, or an
        error that is that sequence's alone), and tokens after a stop string are dropped as
        if never sampled. Returns the touched groups' ids."""
        now = time.time()
        touched = set()
        for seq in updated:
            group, i = self._seq_group[seq.request_id]
            touched.add(group.request_id)
            m = seq.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            first_new = group.seen_tokens[i]
            group.seen_tokens[i] = seq.num_output_tokens
            for j in range(first_new, seq.num_output_tokens):
                last = j == seq.num_output_tokens - 1
                if self._detokenize(group, i, seq, j, logprobs if last else {}, finish):
                    break

        return touched

    def add_prompt_logprobs(self, results: list[PromptLogprobsResult]) -> None:
        """A step's scored prompt positions, into their groups (complete by the time the
        first token is sampled, which is when the first output goes out)."""
        for r in results:
            group, _ = self._seq_group.get(r.key, (None, 0))
            if group is None or group.prompt_logprobs is None:
                continue  # aborted since
            fill_prompt_logprobs(group.prompt_logprobs, group.prompt_token_ids, r,
                                 group.detoks[0].decode_token)

    def _detokenize(self, group: SiblingGroup, i: int, seq: Request, j: int,
                    logprobs: dict[str, TokenLogprobs], finish) -> bool:
        """Output token j of `seq` into its text; True when the sequence ended there."""
        token = seq.token_ids[seq.num_prompt_tokens + j]
        try:
            if seq.logprobs is not None and seq.request_id in logprobs:
                self._add_logprobs(seq, logprobs[seq.request_id], group.detoks[i])
            last = j == seq.num_output_tokens - 1
            stopped_by_token = last and seq.status == RequestStatus.FINISHED_STOPPED
            if stopped_by_token and not seq.sampling_params.include_stop_str_in_output:
                return True  # EOS / stop_token_ids: in token_ids, not in the text
            stop = group.detoks[i].update(token)
        except Exception as e:  # one bad sequence must not take the batch down
            logger.exception("detokenizing request %s failed", seq.request_id)
            group.error = f"detokenization failed: {e}"
            finish(seq, RequestStatus.FINISHED_ERROR)
            return True
        # (a stop string inside a step's accepted tokens wins over how the last one ended)
        if stop is not None and (not seq.finished or j < seq.num_output_tokens - 1):
            seq.drop_output_tokens_after(j + 1)
            group.seen_tokens[i] = seq.num_output_tokens
            seq.stop_reason = stop
            if seq.finished:
                seq.status = RequestStatus.FINISHED_STOPPED
            else:
                finish(seq, RequestStatus.FINISHED_STOPPED)
            return True
        return False

    def _add_logprobs(self, seq: Request, lp: TokenLogprobs,
                      detok: IncrementalDetokenizer) -> None:
        token = seq.token_ids[-1]
        entry = {tid: Logprob(logprob, r + 1, detok.decode_token(tid))
                 for r, (tid, logprob) in enumerate(zip(lp.top_ids, lp.top_logprobs))}
        if token not in entry:
            entry[token] = Logprob(lp.logprob, lp.rank, detok.decode_token(token))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += lp.logprob

    def outputs(self, client_request_ids: set[str]) -> list[RequestOutput]:
        outs = []
        for rid in client_request_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            out = self._output(group)
            if out is not None:
                outs.append(out)
            if group.finished:
                self._drop(group)
        return outs

    def _output(self, group: SiblingGroup) -> RequestOutput | None:
        kind = group.params.output_kind
        finished = group.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for i, (seq, detok) in enumerate(zip(group.seqs, group.detoks)):
            text = detok.visible_text(seq.finished)
            tokens = seq.output_token_ids
            lps = seq.logprobs
            if kind == RequestOutputKind.DELTA:
                text, tokens = text[group.sent_text[i]:], tokens[group.sent_tokens[i]:]
                lps = lps[group.sent_tokens[i]:] if lps is not None else None
            group.sent_text[i] = len(detok.visible_text(seq.finished))
            group.sent_tokens[i] = seq.num_output_tokens
            completions.append(CompletionOutput(
                index=seq.sample_index, text=text, token_ids=list(tokens),
                cumulative_logprob=seq.cumulative_logprob if lps is not None else None,
                logprobs=lps, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        first = group.seqs[0]
        prompt_logprobs = group.prompt_logprobs
        if kind == RequestOutputKind.DELTA and group.sent_prompt_logprobs:
            prompt_logprobs = None
        group.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids, outputs=completions, finished=finished,
            metrics=first.metrics, num_cached_tokens=max(first.num_cached_tokens, 0),
            error=group.error, prompt_logprobs=prompt_logprobs)

    def _drop(self, group: SiblingGroup) -> None:
        self.groups.pop(group.request_id, None)
        for s in group.seqs:
            self._seq_group.pop(s.request_id, None)

    def group_of(self, request_id: str) -> SiblingGroup | None:
        """The sibling group of a client request id, or None."""
        return self.groups.get(request_id)
