"""Bidirectional attention over each image's placeholder run (Gemma 3), as plain positions:
where a prefill chunk may end, and how far ahead each query token may look.

Public interface:
    image_runs(images) -> [(start, end)]       the runs that attend both ways: placeholder
                                               runs, adjacent ones joined (transformers'
                                               blocks are maximal runs of image tokens)
    fit_chunk(images, start, n) -> int         the longest chunk [start, start + m), m <= n,
                                               that does not end inside a run (0 if none)
    longest_run(images) -> int                 the tokens a chunk must hold at once
    key_limits(images, start, n) -> array | None
                                               per query token of the chunk, the last key
                                               position it may see: its own, or its run's
                                               last; None when none looks ahead

transformers (modeling_gemma3.create_masks_for_vision_model) composes global layers as
OR(causal, same run) and sliding ones as AND(window, OR(causal, same run)); with a key limit
per query token that is `key <= limit[q]`, and `key > q - window` on sliding layers. A query
token sees keys ahead only inside its own run, so the whole run must be in one forward: the
scheduler never lets a prefill chunk end inside a run (vLLM's disable_chunked_mm_input). A
chunk may start inside one, after a prefix-cache hit: the cached tokens of the run were
computed with the whole run in view, the rest is computed here, with the cached keys behind.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def image_runs(images: Sequence) -> list[tuple[int, int]]:
    """`images`: ImageSpans (offset, length) in prompt order."""
    runs: list[tuple[int, int]] = []
    for im in images:
        start, end = im.offset, im.offset + im.length
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs


def longest_run(images: Sequence) -> int:
    return max((end - start for start, end in image_runs(images)), default=0)


def fit_chunk(images: Sequence, start: int, n: int) -> int:
    end = start + n
    for lo, hi in image_runs(images):
        if lo < end < hi:  # it would end inside this run: end before it instead
            return max(lo - start, 0)
    return n


def key_limits(images: Sequence, start: int, n: int) -> np.ndarray | None:
    """[n] int64 for the chunk [start, start + n); raises if a run it overlaps goes past its
    end (the scheduler's rule was broken: the attention would silently be causal there)."""
    limits = None
    for lo, hi in image_runs(images):
        first, last = max(lo, start), min(hi, start + n)
        if first >= last or first == hi - 1:  # none of it, or only its last token
            continue
        if hi > start + n:
            raise RuntimeError(f"a prefill chunk [{start}, {start + n}) ends inside the image "
                               f"run [{lo}, {hi}), which must be computed in one forward")
        if limits is None:
            limits = np.arange(start, start + n, dtype=np.int64)
        limits[first - start:last - start] = hi - 1
    return limits
