"""Continuing an answer another replica began (the router's request migration).

The router resends a request whose replica died mid-stream with `continue_token_ids`: the
tokens that replica had already streamed. They follow the prompt, so the engine computes
exactly the state an uninterrupted run had there (the detokenizer starts from them too, so
the text joins up), and generates the rest; the router reduces max_tokens by them itself.
"""

from __future__ import annotations

from quire.entrypoints.errors import bad_request


def continued_prompts(prompt_ids: list[list[int]], req) -> list[list[int]]:
    """The prompts with the request's continue_token_ids after them (one prompt, n == 1)."""
    ids = req.continue_token_ids
    if ids is None:
        return prompt_ids
    if len(prompt_ids) != 1 or (req.n or 1) != 1:
        raise bad_request("continue_token_ids continues one answer: it needs one prompt and "
                          "n == 1", "continue_token_ids")
    if getattr(req, "echo", False):
        raise bad_request("continue_token_ids can't be combined with echo (the first replica "
                          "sent the echo already)", "continue_token_ids")
    return [prompt_ids[0] + list(ids)]
