"""Keeping the server's resident set bounded under glibc malloc.

After a burst of requests, freed memory stays in malloc's arenas: glibc gives a thread its own
arena when threads contend (up to 8 per core), and an arena returns memory to the kernel only
from its top. A server's RSS then grows with bursts and does not come back, although nothing
is leaked: every per-request structure is empty after the requests end and the Python heap is
flat (figures in benchmarks/README.md, "Memory under load"). Two bounds:

- fewer arenas (`--malloc-arena-max`, glibc's MALLOC_ARENA_MAX), set before the server starts
  its threads;
- `malloc_trim(0)` once the model is loaded (a checkpoint quantized on load leaves its float
  tensors' pages free in the heap: ~150 MB of SmolLM2 at int4), and again whenever the server
  is idle after serving requests (checked every `TRIM_INTERVAL` seconds); it returns the free
  pages of every arena to the kernel.

Both are no-ops where the C library is not glibc.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_ARENA_MAX = -8      # mallopt's parameter number for MALLOC_ARENA_MAX (glibc malloc.h)
TRIM_INTERVAL = 5.0   # seconds between two trims: a trim walks every arena

_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.malloc_trim, lib.mallopt  # noqa: B018 - both exist only in glibc
            _libc = lib
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def limit_arenas(max_arenas: int) -> bool:
    """Cap malloc's arenas; call before threads start. False where that is not possible."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, int(max_arenas)))


def trim() -> bool:
    """Return free heap pages of every arena to the kernel; False where not possible."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


async def trim_when_idle(engine, interval: float = TRIM_INTERVAL) -> None:
    """Once the engine has loaded, trim; then every `interval` seconds: if requests came since
    the last trim and none is in flight now, trim (in a thread: it walks every arena). Runs
    until cancelled."""
    await engine.loaded.wait()
    released = await asyncio.to_thread(trim)
    logger.debug("loaded: malloc_trim released memory: %s", released)
    seen = engine.num_requests_added
    while True:
        await asyncio.sleep(interval)
        if engine.num_requests_added != seen and engine.idle:
            seen = engine.num_requests_added
            released = await asyncio.to_thread(trim)
            logger.debug("idle: malloc_trim released memory: %s", released)
