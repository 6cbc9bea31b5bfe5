"""The n-gram proposer's bytes search finds what a plain search over the token list finds:
the continuation of the latest earlier occurrence of the longest suffix in [min, max]
(token ids whose int32 bytes could match across token boundaries included)."""

from __future__ import annotations

import random

from quire.spec_decode.ngram import propose_ngram


def _naive(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_the_bytes_search_agrees_with_a_plain_search():
    rng = random.Random(0)
    # few distinct ids, some whose bytes overlap when packed (256 = 00 01 00 00, ...)
    alphabet = [1, 2, 3, 256, 257, 65537, 1 << 24]
    for _ in range(5000):
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(0, 40))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 4)
        assert propose_ngram(tokens, k, lo, hi) == _naive(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_it_prefers_the_longest_suffix_then_the_latest_occurrence():
    tokens = [9, 1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [7, 5]   # "1 2 3" occurred once before
    assert propose_ngram(tokens, 2, 1, 2) == [8, 1]   # "2 3": its latest earlier occurrence
    assert propose_ngram([4, 5, 6], 3, 1, 3) == []    # nothing recurs
