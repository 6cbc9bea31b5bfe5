"""Engine logprobs in OpenAI's two shapes (completions' parallel lists, chat's token list)."""

from __future__ import annotations

import math

from quire.entrypoints.openai_protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    LogprobOut,
    PromptLogprobsOut,
    TokenLogprob,
    TopLogprob,
)
from quire.outputs import CompletionOutput, Logprob

# JSON has no -inf: a token the model rules out entirely is reported at this floor, as vLLM
# and OpenAI do.
MIN_LOGPROB = -9999.0


def json_logprob(lp: float) -> float:
    return max(lp, MIN_LOGPROB) if not math.isnan(lp) else MIN_LOGPROB


def _token_str(token_id: int, entry: dict[int, Logprob]) -> str:
    lp = entry.get(token_id)
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else ""


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: kv[1].rank)


def completion_logprobs(c: CompletionOutput, k: int | None, offset: int,
                        textless: frozenset[int] = frozenset()) -> CompletionLogprobs | None:
    """`offset`: characters of this choice's text sent before this output; `textless`: the
    token ids that add nothing to the text (special tokens, when they are skipped), so each
    text_offset is where the token's text starts in `text`."""
    if k is None or c.logprobs is None:
        return None
    return token_logprobs(c.token_ids, c.logprobs, k, offset, textless=textless)


def echo_logprobs(prompt_token_ids: list[int], prompt_lps: list[dict[int, Logprob] | None],
                  first_token: str, c: CompletionOutput | None, k: int,
                  textless: frozenset[int] = frozenset()) -> CompletionLogprobs:
    """echo with logprobs: the prompt's tokens (the first has no logprob: nothing predicts
    it; `first_token` is its text), then the output's (`c`; None with max_tokens 0), as
    vLLM answers them."""
    ids, entries = list(prompt_token_ids), list(prompt_lps)
    if c is not None and c.logprobs is not None:
        ids += c.token_ids
        entries += c.logprobs
    return token_logprobs(ids, entries, k, 0, first_token, textless)


def token_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], k: int,
                   offset: int, unscored_token: str = "",
                   textless: frozenset[int] = frozenset()) -> CompletionLogprobs:
    """Completions' parallel lists; an entry of None (a prompt's first token) gets a null
    logprob and top_logprobs, and `unscored_token` as its text. `textless`: token ids that
    add nothing to the text (skipped special tokens): the offset does not move past them."""
    result = CompletionLogprobs()
    for tid, entry in zip(token_ids, entries):
        if entry is None:
            result.tokens.append(unscored_token)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(offset)
            offset += len(unscored_token)
            continue
        tok = _token_str(tid, entry)
        chosen = entry.get(tid)  # the engine always includes the sampled token
        result.tokens.append(tok)
        result.token_logprobs.append(json_logprob(chosen.logprob) if chosen else None)
        top = {}
        for t, lp in _ranked(entry):
            if lp.rank <= k or t == tid:
                top.setdefault(lp.decoded_token or "", json_logprob(lp.logprob))
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        if tid not in textless:
            offset += len(tok)
    return result


def prompt_logprobs_out(lps: list[dict[int, Logprob] | None] | None) -> PromptLogprobsOut | None:
    """RequestOutput.prompt_logprobs in vLLM's JSON shape."""
    if lps is None:
        return None
    return [None if entry is None else
            {tid: LogprobOut(logprob=json_logprob(lp.logprob), rank=lp.rank,
                             decoded_token=lp.decoded_token) for tid, lp in entry.items()}
            for entry in lps]


def chat_logprobs(c: CompletionOutput, k: int | None) -> ChatLogprobs | None:
    if k is None or c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs):
        tok = _token_str(tid, entry)
        chosen = entry.get(tid)
        top = [TopLogprob(token=lp.decoded_token or "", logprob=json_logprob(lp.logprob),
                          bytes=list((lp.decoded_token or "").encode()))
               for _, lp in _ranked(entry) if lp.rank <= k]
        logprob = json_logprob(chosen.logprob) if chosen else MIN_LOGPROB
        content.append(TokenLogprob(token=tok, logprob=logprob, bytes=list(tok.encode()),
                                    top_logprobs=top[:k]))
    return ChatLogprobs(content=content)
