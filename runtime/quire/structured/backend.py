"""The one grammar library behind quire/structured: llguidance.

Chosen over xgrammar and outlines-core (benchmarks/grammar_backends.py, SmolLM2's 49k vocab):
compiling a JSON schema takes ~2 ms (xgrammar ~590 ms, outlines-core ~840 ms), which matters
because every tool list and response_format is a new schema; a mask costs ~70 us per token on
average, far below a decode step; unsupported schema keywords are errors that name the keyword,
never silently ignored; Lark grammars can embed JSON schemas (`%json {...}`), which the tool-call
grammars use; matchers fork with deep_copy (beam search); and it is one wheel with no
dependencies. Swapping libraries means rewriting this file only.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

# llguidance's numpy helpers, not llguidance.torch: that module wraps its mask kernel in
# torch.compile at import, which loads dynamo and inductor (~3.5 s in every process that
# imports the engine); the mask filling itself is the same native call on the same memory
import llguidance
import llguidance.hf
import llguidance.numpy
import torch
from llguidance.gbnf_to_lark import any_to_lark

from quire.validation import QuireValidationError

logger = logging.getLogger(__name__)


def grammar_text(params) -> str:
    """The llguidance grammar for GuidedDecodingParams (a serialized grammar, not compiled)."""
    kind = params.kind
    M = llguidance.LLMatcher
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        try:
            return M.grammar_from_json_schema(schema, defaults=options)
        except ValueError as e:
            raise QuireValidationError("json", f"json is not a valid JSON schema: {e}",
                                       schema) from None
    if kind == "regex":
        return M.grammar_from_regex(params.regex)
    if kind == "choice":  # Lark string literals take JSON's escapes
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return M.grammar_from_lark(f"start: {alternatives}\n")
    return M.grammar_from_lark(any_to_lark(params.grammar))  # Lark as is; GBNF converted


def check_grammar(params) -> None:
    """QuireValidationError naming the kind and what is wrong or unsupported; cached per
    grammar."""
    with _checked_lock:
        error = _checked.get(params.key)
    if error is None:
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar_text(params))
        except Exception as e:  # GBNF that doesn't convert, a schema that isn't JSON
            error = str(e)
        with _checked_lock:
            _checked[params.key] = error
            if len(_checked) > MAX_CHECKED:
                _checked.popitem(last=False)
    if error:
        raise QuireValidationError(params.kind, f"{params.kind}: {error}")


MAX_CHECKED = 1024
_checked_lock = threading.Lock()  # requests are built on many threads
_checked: OrderedDict = OrderedDict()  # grammar key -> error ("" when valid); a plain bounded
                                       # FIFO, as lru_cache can't hash schema dicts


class CompiledGrammar:
    """A grammar bound to the tokenizer; every sequence gets its own matcher from it."""

    def __init__(self, prototype: llguidance.LLMatcher) -> None:
        self._prototype = prototype

    def new_matcher(self) -> Matcher:
        return Matcher(self._prototype.deep_copy())


class Matcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_m",)

    def __init__(self, m: llguidance.LLMatcher) -> None:
        self._m = m

    def accept(self, token_id: int) -> bool:
        return self._m.consume_token(token_id)

    def valid_prefix_length(self, token_ids: list[int]) -> int:
        """How many of these tokens, in order, the grammar would accept (consumes none)."""
        return self._m.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> bool:
        return self._m.rollback(num_tokens)

    def reset(self) -> None:
        self._m.reset()

    def fork(self) -> Matcher:
        return Matcher(self._m.deep_copy())

    def is_terminated(self) -> bool:
        """Nothing but EOS can follow (or EOS was consumed)."""
        return self._m.is_stopped()

    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class Backend:
    """The tokenizer in llguidance's form (~0.4 s to build at 49k tokens: built once, off the
    engine thread), grammar compilation and batched mask filling."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        n_vocab = max(vocab_size, len(hf_tokenizer))
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab,
                                                      eos_token=sorted(eos_token_ids))
        self.executor = llguidance.LLExecutor()

    def compile(self, params) -> CompiledGrammar:
        m = llguidance.LLMatcher(self.tokenizer, grammar_text(params), log_level=0)
        if m.is_error():
            raise QuireValidationError(params.kind, f"{params.kind}: {m.get_error()}")
        # the first mask, on a copy: a spec that no text matches ({"$ref": "#"}, the regex
        # [^\s\S]) is refused here, not answered with an empty output it does not match
        first = m.deep_copy()
        first.compute_bitmask()
        if first.is_error():
            raise QuireValidationError(params.kind, f"{params.kind}: no text matches it "
                                                    f"({first.get_error()[:200]})")
        return CompiledGrammar(m)

    def fill_bitmask(self, matchers: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Rows `i` of the int32 [rows, ceil(vocab / 32)] bitmask get each matcher's mask;
        many rows are filled in parallel on llguidance's own threads (the GIL released)."""
        if len(matchers) == 1:
            m, i = matchers[0]
            llguidance.numpy.fill_next_token_bitmask(m._m, bitmask.numpy(), i)
        else:
            llguidance.numpy.fill_next_token_bitmask_par(
                self.executor, [(m._m, i) for m, i in matchers], bitmask.numpy())


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
