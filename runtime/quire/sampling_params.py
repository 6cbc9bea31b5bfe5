"""SamplingParams: how one request is decoded, validated when it is built (a
QuireValidationError carrying the field at fault)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from quire.structured.params import GuidedDecodingParams
from quire.validation import QuireValidationError, check_int, check_number

GREEDY_EPSILON = 1e-5  # temperatures below this decode greedily, as in vLLM
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # torch generators take a signed 64-bit seed


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1       # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16         # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None         # top-k logprobs per generated token
    # top-k logprobs per prompt token (plus the token's own), from the prefill's logits;
    # RequestOutput.prompt_logprobs, first position None (vLLM's)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = field(default=RequestOutputKind.CUMULATIVE)
    guided_decoding: GuidedDecodingParams | None = None  # structured output (quire/structured)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        check_int("n", self.n, lo=1)
        check_number("temperature", self.temperature, lo=0.0, hi=None,
                     what="a finite number >= 0")
        check_number("top_p", self.top_p, lo=0.0, hi=1.0, what="in (0, 1]")
        if self.top_p <= 0.0:
            raise QuireValidationError("top_p", f"top_p must be in (0, 1], got {self.top_p}",
                                       self.top_p)
        check_int("top_k", self.top_k, lo=0, what="0 or -1 (disabled) or a positive integer")
        check_number("min_p", self.min_p, lo=0.0, hi=1.0, what="in [0, 1]")
        check_number("repetition_penalty", self.repetition_penalty, lo=0.0, hi=None,
                     what="a finite number > 0")
        if self.repetition_penalty <= 0.0:
            raise QuireValidationError(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                self.repetition_penalty)
        check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0, what="in [-2, 2]")
        check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0, what="in [-2, 2]")
        if self.seed is not None:
            check_int("seed", self.seed, lo=0, hi=MAX_SEED, what=f"an integer in [0, {MAX_SEED}] or None")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise QuireValidationError(
                    "stop", f"stop must be a string or a list of non-empty strings, got {s!r}", s)
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t, lo=0, what="a list of non-negative token ids")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise QuireValidationError(
                    name, f"{name} must be a boolean, got {getattr(self, name)!r}",
                    getattr(self, name))
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, lo=1, what="a positive integer or None")
        check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise QuireValidationError(
                "min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                self.min_tokens)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS,
                 what=f"an integer in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS,
                      what=f"an integer in [0, {MAX_LOGPROBS}] or None")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise QuireValidationError(
                "output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}",
                self.output_kind)
        if self.guided_decoding is not None and not isinstance(self.guided_decoding,
                                                               GuidedDecodingParams):
            raise QuireValidationError("guided_decoding",
                                       f"guided_decoding must be a GuidedDecodingParams, "
                                       f"got {self.guided_decoding!r}", self.guided_decoding)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self, **changes) -> SamplingParams:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)

