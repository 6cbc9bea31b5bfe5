"""Grammar compilation off the engine thread, with a bounded LRU cache of compiled grammars.

Why a thread pool rather than compiling in add_request: the async engine calls add_request on
its engine thread, so a compile there would stall every running request's next token. Here
add_request only submits; the request waits in the scheduler's queue until its future is done
(other requests go past it). The first compile also builds the tokenizer's llguidance form
(~0.4 s), likewise off the engine thread. The cache holds futures, so concurrent requests with
one schema share one compile.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict

from quire.structured.params import GuidedDecodingParams

DEFAULT_CACHE_SIZE = 256


class GrammarCompiler:
    def __init__(self, make_backend, cache_size: int = DEFAULT_CACHE_SIZE,
                 num_threads: int = 1) -> None:
        self._make_backend = make_backend  # called once, in the pool: builds the tokenizer
        self._backend = None
        self._backend_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, "quire-grammar")
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size

    def submit(self, params: GuidedDecodingParams) -> concurrent.futures.Future:
        """A future of the CompiledGrammar; a cache hit is already done."""
        with self._lock:
            future = self._cache.get(params.key)
            if future is not None:
                self._cache.move_to_end(params.key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[params.key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # requests hold their own future
        future.add_done_callback(lambda f: f.exception() and self._forget(params.key, f))
        return future

    @property
    def backend(self):
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def _compile(self, params: GuidedDecodingParams):
        return self.backend.compile(params)

    def _forget(self, key: tuple, future) -> None:
        with self._lock:  # a failure is not cached: the next request tries again
            if self._cache.get(key) is future:
                del self._cache[key]

    def __len__(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
