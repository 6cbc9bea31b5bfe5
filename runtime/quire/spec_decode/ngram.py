"""N-gram proposals (prompt lookup): the tokens that followed the latest earlier occurrence of
the sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max].

Copying tasks (quoting, editing, RAG answers, code edits) repeat spans of their own context, so
these proposals are often right and cost a substring search: the token ids are packed as int32
bytes and searched with bytes.rfind (C), a match counting only where it is token-aligned.
"""

from __future__ import annotations

from array import array


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens to propose after `token_ids`; [] when no n-gram recurs."""
    length = len(token_ids)
    if k <= 0 or length < min_n + 1:
        return []
    buf = array("i", token_ids).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = buf[(length - n) * 4:]
        end = (length - 1) * 4  # a match must leave a token after it, and not be the tail
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return token_ids[start:start + k]
            end = at + len(pattern) - 1  # an unaligned hit: look further left
    return []
