"""Long-lived CPU buffers on transparent huge pages: the packed weights a decode step streams.

At batch 1 a decode step reads every weight once (the default SmolLM2: 96 MB a token, 121
packed weights). On 4 KiB pages that is ~24,000 pages a step, far past the TLB's reach, and
each step's stream also pushes out the page-table entries of everything else the step touches
(the interpreter's objects, the KV cache), so their next accesses walk cold tables too. On
2 MiB pages the whole model is ~50 TLB entries. On the AMX Xeon (2 threads, bfloat16) a
batch-1 decode step went from 6.59 to 5.79 ms (benchmarks/decode_profile.py --baseline,
alternated fresh processes) and decode from 81% to 93% of the read roofline
(benchmarks/README.md).

torch's allocator madvises nothing by default (THP_MEM_ALLOC_ENABLE, read once before any
allocation, is too late to set from here), and most packed weights are below 2 MiB each, so
they are copied, once after loading, into one private anonymous mapping madvised
MADV_HUGEPAGE, 2 MiB aligned: its pages come as huge pages on first touch (the copy). Where
the kernel's transparent huge pages are `never`, or the OS has no madvise, nothing moves.
QUIRE_HUGE_PAGES=0 turns it off (benchmarks compare the two). The bytes are the same, so
every result is the same."""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor's start, as torch's allocator aligns them
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def available() -> bool:
    """Whether moving buffers here gives huge pages: Linux's madvise, transparent huge pages
    not `never`, and QUIRE_HUGE_PAGES not 0."""
    if os.environ.get("QUIRE_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_MODE) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def footprint(tensors: list[torch.Tensor]) -> int:
    """The bytes an Arena needs for copies of `tensors`."""
    return sum(-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors)


class Arena:
    """One private anonymous mapping of at least `nbytes`, madvised MADV_HUGEPAGE before its
    first touch (its faults then take huge pages), used from a 2 MiB boundary. `copy` places
    tensors in it one after another, so a caller that drops each original as it goes holds
    the weights about once, not twice. The mapping lives as long as any copy."""

    def __init__(self, nbytes: int) -> None:
        region = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE,
                           flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        self._raw = torch.from_numpy(np.frombuffer(region, dtype=np.uint8))  # holds `region`
        self._at = -self._raw.data_ptr() % HUGE_PAGE
        self._end = self._at + nbytes

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` (a contiguous CPU tensor) here, same dtype and shape."""
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"Arena.copy takes a contiguous CPU tensor, got one on "
                             f"{t.device.type}, contiguous={t.is_contiguous()}")
        n = t.numel() * t.element_size()
        if self._at + n > self._end:
            raise ValueError(f"Arena.copy: {n} bytes do not fit in the {self._end - self._at} "
                             f"left")
        out = self._raw[self._at:self._at + n].view(t.dtype).view(t.shape).copy_(t)
        self._at += -(-n // _ALIGN) * _ALIGN
        return out


def arena(nbytes: int) -> Arena | None:
    """An Arena of `nbytes`, or None where `available()` is false."""
    return Arena(nbytes) if available() and nbytes > 0 else None
