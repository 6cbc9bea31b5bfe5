"""`speculative_config`: vLLM's keys and meanings, checked once, errors naming the key.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2}
    {"model": "path/to/draft (a folder or a .gguf)", "num_speculative_tokens": 4}

Given as a dict (LLM(...)) or a JSON string (`--speculative-config`). A draft model must share
the target's vocabulary; that is checked when both are loaded (spec_decode/draft.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from quire.validation import QuireValidationError, is_strict_int

METHODS = ("ngram", "draft_model")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
        "quantization", "draft_tensor_parallel_size", "disable_adaptive",
        "adaptive_min_acceptance", "adaptive_window")
MAX_SPECULATIVE_TOKENS = 16  # verification rows grow the step by this much per sequence


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    model: str | None = None          # the draft model (draft_model)
    quantization: str | None = None   # the draft's --quantization (default: the target's)
    # adaptive: a sequence whose recent proposals are mostly rejected stops proposing for a
    # while, so plain text costs what it costs without speculation
    disable_adaptive: bool = False
    adaptive_min_acceptance: float = 0.25  # accepted / proposed over the window
    adaptive_window: int = 8               # verifications the rate is judged over

    @classmethod
    def parse(cls, value: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise _bad(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise _bad("speculative_config must be a JSON object (a dict), "
                             f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise _bad(f"speculative_config.{unknown[0]} is not a known key; the keys "
                             f"are {', '.join(KEYS)}")
        v = dict(value)
        method = v.pop("method", None)
        if method is None:
            method = "draft_model" if v.get("model") else None
        if method == "draft":
            method = "draft_model"
        if method not in METHODS:
            raise _bad(f"speculative_config.method must be one of {', '.join(METHODS)} "
                             f"(or give speculative_config.model for a draft), got {method!r}")
        if "num_speculative_tokens" not in v:
            raise _bad("speculative_config.num_speculative_tokens is required (an integer "
                             f"in [1, {MAX_SPECULATIVE_TOKENS}])")
        k = v.pop("num_speculative_tokens")
        _int("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        lo, hi = v.pop("prompt_lookup_min", None), v.pop("prompt_lookup_max", None)
        model = v.pop("model", None)
        if method == "ngram":
            if model is not None:
                raise _bad("speculative_config.model is for method draft_model; ngram "
                                 "proposes from the sequence itself")
            if lo is None and hi is None:  # vLLM's defaults
                lo = hi = 5
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            _int("prompt_lookup_min", lo, 1, 1024)
            _int("prompt_lookup_max", hi, 1, 1024)
            if lo > hi:
                raise _bad(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                                 f"prompt_lookup_max ({hi})")
        else:
            if lo is not None or hi is not None:
                raise _bad("speculative_config.prompt_lookup_min/max are for method "
                                 "ngram")
            if not isinstance(model, str) or not model:
                raise _bad("speculative_config.model must name the draft model (a folder "
                                 "or a .gguf file)")
            lo = hi = 0
        tp = v.pop("draft_tensor_parallel_size", 1)
        if tp != 1:
            raise _bad(f"speculative_config.draft_tensor_parallel_size must be 1 (the "
                             f"draft runs on rank 0), got {tp!r}")
        quant = v.pop("quantization", None)
        if quant is not None and not isinstance(quant, str):
            raise _bad(f"speculative_config.quantization must be a string, got {quant!r}")
        off = v.pop("disable_adaptive", False)
        if not isinstance(off, bool):
            raise _bad(f"speculative_config.disable_adaptive must be true or false, "
                             f"got {off!r}")
        rate = v.pop("adaptive_min_acceptance", 0.25)
        if (not isinstance(rate, (int, float)) or isinstance(rate, bool)
                or not 0.0 <= rate <= 1.0):
            raise _bad(f"speculative_config.adaptive_min_acceptance must be a number in [0, 1], "
                       f"got {rate!r}")
        window = v.pop("adaptive_window", 8)
        _int("adaptive_window", window, 1, 4096)
        return cls(method, k, hi, lo, model, quant, off, float(rate), window)


def _bad(message: str) -> QuireValidationError:
    return QuireValidationError("speculative_config", message)


def _int(key: str, value: object, lo: int, hi: int) -> None:
    if not (is_strict_int(value) and lo <= value <= hi):
        raise _bad(f"speculative_config.{key} must be an integer in [{lo}, {hi}], got {value!r}")
