"""Python's cyclic garbage collector paused while an engine is built.

Loading allocates objects fast enough (a model's modules and parameters, the tokenizer's
vocabulary, the block pool's KVBlocks) to start a collection every few hundred of them, and
each full one walks the whole heap, torch's and transformers' modules included: ~1 s of a
SmolLM2 load's 3.3-4.0 s (2-core Xeon; 2.8-3.0 s paused, the same peak RSS). Objects still go
when their last reference does; cycles made meanwhile wait for the next collection."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """The collector off inside the block, back to its state before after it (nests)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
