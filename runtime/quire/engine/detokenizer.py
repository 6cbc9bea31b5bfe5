"""Incremental detokenization and stop strings.

Text grows one token at a time without re-decoding the whole output, never ends inside a
multi-byte character, and stop strings are found even when they straddle tokens. While a
stop string could still be forming, its possible beginning is held back from streams.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from quire.sampling_params import SamplingParams

_PROMPT_CONTEXT = 6  # prompt tokens the stream starts from, so spacing follows the prompt


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.text = ""
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} is not a fast (Rust) "
                             "tokenizer; Quire needs one for incremental detokenization")
        self._stream = DecodeStream(prompt_token_ids[-_PROMPT_CONTEXT:],
                                    skip_special_tokens=params.skip_special_tokens)
        self._hold = params.max_stop_len - 1 if params.stop and not params.include_stop_str_in_output else 0

    def update(self, token_id: int) -> str | None:
        """Add one token. Returns the stop string it completed, if any (text is then trimmed)."""
        before = len(self.text)
        self.text += self._next_piece(token_id)
        if not self.params.stop:
            return None
        start = max(0, before - self.params.max_stop_len + 1)
        best = None
        for stop in self.params.stop:
            i = self.text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        self.text = self.text[: i + len(stop)] if self.params.include_stop_str_in_output else self.text[:i]
        return stop

    def visible_text(self, finished: bool) -> str:
        """What may be shown now: all of it once finished, else minus a possible stop's start."""
        if finished or not self._hold:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]

    def _next_piece(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
