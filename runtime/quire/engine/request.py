"""The scheduler's unit: one *sequence* (glossary) with its state machine and token counts.

Vocabulary, as in DESIGN.md's glossary:
- a client *request* (one prompt, its SamplingParams) becomes one or more sequences; each is a
  `Request` object here, as in vLLM v1. `request_id` names the sequence (unique in the
  engine); `client_request_id` names the client request it belongs to.
- its *sibling group*: the sequences of one client request that share its prompt blocks. With
  n > 1 samples the first sequence computes the prompt; the others wait in `pending_siblings`
  and are forked from it (sharing its KV blocks) at the step its prompt completes.
- a *lockstep group* (`lockstep_group`): the live beams of one beam search; the scheduler
  runs and preempts them as a unit.

A Request holds what the scheduler needs and nothing a feature owns: grammar states,
speculation states, beam groups and seeded generators live in their owners' stores, keyed by
`request_id` (engine/features/, the executor). Only the engine's bookkeeping modules write a
Request (tests/engine/test_boundaries.py names them).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from quire.outputs import RequestMetrics
from quire.sampling_params import SamplingParams

if TYPE_CHECKING:
    from quire.lora.request import AdapterHandle
    from quire.multimodal.inputs import ImageSpan
    from quire.multimodal.mrope import MRopePositions


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_tokens: int,
        arrival_time: float | None = None,
        client_request_id: str | None = None,
        sample_index: int = 0,
        lora: AdapterHandle | None = None,
        cache_salt: str | None = None,
        lockstep_group: str | None = None,
        priority: int = 0,
        images: tuple[ImageSpan, ...] = (),
        mrope: MRopePositions | None = None,
    ) -> None:
        self.request_id = request_id  # this sequence's id
        self.client_request_id = client_request_id or request_id  # the id the client gave
        self.sample_index = sample_index
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.max_tokens = max_tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then outputs
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time or time.time())
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict] | None = [] if sampling_params.logprobs is not None else None
        self.pending_siblings: list[Request] = []  # (n > 1) forked when the prompt is done
        self.block_hashes: list[bytes] = []     # chained hashes of this request's full blocks
        self.num_preemptions = 0
        # the beam search whose live beams run and are preempted with it as a unit
        self.lockstep_group = lockstep_group
        self.lora = lora  # the AdapterHandle it computes with (quire/lora); None: base model
        # with the adapter, these seed its block-hash chain (block_hash.ExtraKeys): blocks
        # under other keys never match
        self.cache_salt = cache_salt  # the client's cache_salt (tenant isolation)
        self.priority = priority  # lower first under the priority policy (sched_policy.py)
        self.long_rope = False  # its K/V use LongRoPE's long table (scheduler.py)
        # its prompt's images: placeholder runs and content hashes, plain data (the pixels
        # and embeddings are the executor's); they join the block hashes of their blocks
        self.images = tuple(images)
        # M-RoPE (Qwen2.5-VL): its prompt's position triples and the delta of every later
        # position (plain data, read by the batch builder); None: positions are 0..n-1
        self.mrope = mrope

    # --- token bookkeeping ---------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_seqs(self) -> int:
        """Sequences this one will occupy once its pending siblings join."""
        return 1 + len(self.pending_siblings)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def drop_output_tokens_after(self, num_output_tokens: int) -> None:
        """A stop string or a grammar ended the answer at this many output tokens: the tokens
        after it (accepted proposals of the same step) are not part of the output. (Their
        logprobs never exist: a sequence that returns logprobs does not speculate.)"""
        del self.token_ids[self.num_prompt_tokens + num_output_tokens:]

    # --- state ---------------------------------------------------------------------------
    def start_running(self, num_computed_tokens: int, forked_from: Request | None = None) -> None:
        """Admitted with `num_computed_tokens` already in its blocks (prefix hits), or forked
        (sharing all of the parent's)."""
        self.num_computed_tokens = num_computed_tokens
        if forked_from is not None:
            self.num_cached_tokens = forked_from.num_cached_tokens
            self.metrics.first_scheduled_time = forked_from.metrics.first_scheduled_time
        if self.num_cached_tokens < 0:
            self.num_cached_tokens = num_computed_tokens
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = time.time()
        self.status = RequestStatus.RUNNING

    def end(self, status: RequestStatus) -> None:
        """Finished, with its pending siblings (never forked: they end with it)."""
        now = time.time()
        for seq in (self, *self.pending_siblings):
            seq.status = status
            seq.metrics.finished_time = now
        self.pending_siblings = []

    # --- stopping ------------------------------------------------------------------------
    def check_stop(self) -> RequestStatus | None:
        """Token-level stops (EOS, stop_token_ids, length); stop strings are the detokenizer's.
        Returns the status to finish with, or None to go on."""
        last = self.token_ids[-1]
        if self.num_output_tokens >= self.sampling_params.min_tokens:
            if last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in self.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
