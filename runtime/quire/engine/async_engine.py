"""AsyncLLMEngine: owns one LLMEngine and gives each request an async stream of outputs.

The engine is synchronous and not thread-safe, so exactly one background task touches it:
it loads the model, applies the adds and aborts that coroutines queued, and runs `step()` in a
single worker thread (the event loop keeps serving while a step computes). Between steps it
hands each request's outputs to that request's stream and publishes a snapshot for metrics.

    stream = await engine.add_request(request_id, prompt, params)   # ValueError: bad input
    async for output in stream: ...                                 # one output per step
    stream.abort()                                                  # the client went away
    await engine.add_lora(name, path) / await engine.remove_lora(name)   # LoRA at runtime

`lora_adapters` mirrors the engine's registered adapters on the event loop, so the server
picks a request's adapter without waiting on the engine thread. An adapter is read and packed
on a thread of its own (the engine keeps stepping) and registered between two steps; a
request for an adapter removed after the server picked it fails with AdapterNotFound.

A failure inside one request ends that request's stream with `RequestFailed`; a failure of
the loop itself ends every stream with `EngineDeadError`, marks the engine dead and calls
`on_fatal` (the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from quire.config import EngineArgs
from quire.engine.stats import EngineSnapshot, StepEvents
from quire.lora.request import LoRARequest
from quire.lora.stats import lora_stats
from quire.outputs import RequestOutput
from quire.sampling_params import SamplingParams
from quire.validation import QuireValidationError

logger = logging.getLogger(__name__)

IDLE_BACKOFF_MAX = 0.05  # seconds between steps that schedule nothing (work that cannot run yet)


class EngineNotReady(RuntimeError):
    """The model is still loading."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is at --max-queue-len."""


class EngineShuttingDown(RuntimeError):
    """The server is draining and admits no new requests."""


class EngineDeadError(RuntimeError):
    """The engine loop (or the model load) failed; nothing more will be served."""


class RequestFailed(RuntimeError):
    """This request failed on its own (RequestOutput.error); others go on."""


class AdapterNotFound(LookupError):
    """The LoRA adapter a request or an unload names is not loaded."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class AdapterExists(ValueError):
    """A load names an adapter that is loaded (or being loaded) already."""


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs to know about the loaded model, without reaching into it."""
    name: str                 # the model's own name
    served_name: str          # the name clients use
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    capacity_tokens: int      # tokens the KV cache holds
    architecture: str = ""    # config.json's architecture (the server picks formats by it)


class StatsSink(Protocol):
    def bind(self, model_name: str) -> None: ...
    def record(self, snapshot: EngineSnapshot, events: StepEvents) -> None: ...
    def record_finished(self, output: RequestOutput) -> None: ...


class RequestStream:
    """The outputs of one request, in order; iteration ends after the finished output."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False  # the consumer has seen the end (or aborted)

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.error:
                raise RequestFailed(item.error)
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


@dataclass
class _PendingAdd:
    request_id: str
    prompt: object
    params: SamplingParams
    arrival_time: float
    future: asyncio.Future
    lora_request: LoRARequest | None = None


@dataclass
class _EngineCall:
    fn: Callable
    args: tuple
    future: asyncio.Future
    then: Callable[[bool], None] | None = None  # on the loop, once it ran (ok or not), even
                                                # if the caller has stopped waiting

    def end(self, result=None, error: BaseException | None = None) -> None:
        if self.then is not None:
            self.then(error is None)
        if self.future.done():
            return
        if error is None:
            self.future.set_result(result)
        else:
            self.future.set_exception(error)


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs | None = None, *, engine_factory: Callable | None = None,
                 served_model_name: str | None = None, max_queue_len: int | None = None,
                 stats: StatsSink | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        if engine_factory is None:
            if args is None:
                raise ValueError("give EngineArgs or an engine_factory")
            from quire.engine.engine import LLMEngine

            def engine_factory():
                return LLMEngine(args, serving=True)
        self._factory = engine_factory
        self._served_model_name = served_model_name
        self.max_queue_len = max_queue_len
        self.stats = stats
        self.on_fatal = on_fatal

        self.engine = None          # the LLMEngine, once loaded
        self.model_info: ModelInfo | None = None  # once loaded
        self.tokenizer = None       # a copy for the server's own tokenizing threads
        self.ready = False          # loaded, looping, admitting
        self.accepting = True       # False once draining starts
        self.fatal_error: str | None = None
        self.last_snapshot: EngineSnapshot | None = None
        self.loaded: asyncio.Event | None = None  # set once the load ended (either way)
        self.busy = False           # the worker thread is running engine code
        self.num_requests_added = 0  # lifetime count, so watchers can tell activity happened
        self.lora_adapters: dict[str, LoRARequest] = {}  # the engine's, mirrored on the loop
        self._lora_loading: set[str] = set()  # names being read or registered right now
        self._next_lora_id = 1

        self._executor = concurrent.futures.ThreadPoolExecutor(1, "quire-engine")
        self._streams: dict[str, RequestStream] = {}
        self._adds: list[_PendingAdd] = []
        self._calls: list[_EngineCall] = []  # engine calls (LoRA), run between steps
        self._aborts: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    # --- properties the server reads -----------------------------------------------------
    @property
    def served_model_name(self) -> str | None:
        if self._served_model_name:
            return self._served_model_name
        return self.model_info.name if self.model_info is not None else None

    @property
    def alive(self) -> bool:
        """False once the loop (or the load) has failed."""
        return self.fatal_error is None

    @property
    def idle(self) -> bool:
        """No request is queued, running or being added."""
        return not (self._streams or self._adds)

    def queue_len(self) -> int:
        waiting = self.last_snapshot.num_waiting if self.last_snapshot else 0
        return waiting + len(self._adds)

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Start loading the model and, once loaded, the engine loop; returns at once."""
        self._wake = asyncio.Event()
        self.loaded = asyncio.Event()
        self._task = asyncio.create_task(self._main(), name="quire-engine-loop")

    async def wait_ready(self) -> None:
        await self.loaded.wait()
        if self.fatal_error:
            raise EngineDeadError(self.fatal_error)

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            self.engine = await loop.run_in_executor(self._executor, self._in_worker,
                                                     self._factory)
            self.tokenizer = copy.deepcopy(self.engine.tokenizer)
            e = self.engine
            self.model_info = ModelInfo(
                name=e.model_name, served_name=self._served_model_name or e.model_name,
                max_model_len=e.max_model_len, vocab_size=e.model_config.vocab_size,
                max_num_seqs=e.args.max_num_seqs, capacity_tokens=e.capacity_tokens,
                architecture=getattr(e.model_config, "architecture", ""))
            loras = e.list_loras() if getattr(e, "lora", None) is not None else []
            self.lora_adapters = {r.name: r for r in loras}
            self._next_lora_id = max((r.id for r in loras), default=0) + 1
        except asyncio.CancelledError:  # shut down while loading
            self.loaded.set()
            raise
        except Exception as e:  # noqa: BLE001 - a failed load is fatal, whatever it was
            self.loaded.set()
            self._die(e, "loading the model failed")
            return
        if self._stopping:
            self.loaded.set()
            return
        if self.stats is not None:
            self.stats.bind(self.served_model_name)
        self._publish_stats()
        self.ready = self.accepting
        self.loaded.set()
        logger.info("engine ready: serving %s as %r (loaded in %.1fs)", self.engine.model_name,
                    self.served_model_name, time.perf_counter() - t0)
        try:
            await self._loop(loop)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._die(e, "the engine loop failed")

    def _in_worker(self, fn, *args):
        self.busy = True
        try:
            return fn(*args)
        finally:
            self.busy = False

    async def _loop(self, loop: asyncio.AbstractEventLoop) -> None:
        engine = self.engine
        idle_backoff = 0.0
        while True:
            if self._calls:
                await self._run_calls(loop)
            if self._adds or self._aborts:
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, set()
                errors = await loop.run_in_executor(self._executor, self._in_worker,
                                                    self._apply, adds, aborts)
                for add, error in zip(adds, errors):
                    if error is not None:
                        self._streams.pop(add.request_id, None)
                    if add.future.done():
                        continue  # the caller went away; its abort is queued
                    if error is None:
                        add.future.set_result(None)
                    else:
                        add.future.set_exception(error)
                self._publish_stats()
            if engine.has_unfinished_requests():
                outputs = await loop.run_in_executor(self._executor, self._in_worker,
                                                     engine.step)
                self._dispatch(outputs)
                self._publish_stats()
                if outputs or self.last_snapshot.num_running:
                    idle_backoff = 0.0
                else:  # queued work that cannot be scheduled yet: don't spin a core on it
                    idle_backoff = min(IDLE_BACKOFF_MAX, idle_backoff * 2 or 0.001)
                    await self._sleep_or_wake(idle_backoff)
            elif self._stopping:
                return
            elif not (self._adds or self._aborts or self._calls):
                self._wake.clear()
                await self._wake.wait()

    async def _sleep_or_wake(self, seconds: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def _apply(self, adds: list[_PendingAdd], aborts: set[str]) -> list[Exception | None]:
        """In the worker thread, between steps: add (validating) and abort requests."""
        errors: list[Exception | None] = []
        for add in adds:
            try:
                lora = add.lora_request
                if lora is None:
                    self.engine.add_request(add.request_id, add.prompt, add.params,
                                            add.arrival_time)
                elif self.engine.get_lora(lora.name) != lora:
                    raise AdapterNotFound(lora.name)  # unloaded since the server picked it
                else:
                    self.engine.add_request(add.request_id, add.prompt, add.params,
                                            add.arrival_time, lora_request=lora)
                errors.append(None)
            except (ValueError, AdapterNotFound) as e:
                errors.append(e)
            except Exception as e:  # noqa: BLE001 - one odd request must not stop the loop
                logger.exception("adding request %s failed", add.request_id)
                errors.append(RequestFailed(f"could not add the request: {e}"))
        if aborts:
            self.engine.abort_request(list(aborts))
        return errors

    async def _run_calls(self, loop: asyncio.AbstractEventLoop) -> None:
        calls, self._calls = self._calls, []
        for call in calls:
            try:
                result = await loop.run_in_executor(self._executor, self._in_worker, call.fn,
                                                    *call.args)
            except Exception as e:  # noqa: BLE001 - the caller gets it; the loop goes on
                call.end(error=e)
                continue
            call.end(result)
        self._publish_stats()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                if self.stats is not None:
                    self.stats.record_finished(out)
                stream = self._streams.pop(out.request_id, None)
            else:
                stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(out)

    def _publish_stats(self) -> None:
        self.last_snapshot = self.engine.snapshot()
        if getattr(self.engine, "lora", None) is not None:
            self.last_snapshot.lora = lora_stats(self.engine.lora, self.engine.scheduler)
        events = self.engine.drain_events()
        if self.stats is not None:
            self.stats.record(self.last_snapshot, events)

    def _die(self, error: BaseException, what: str) -> None:
        if self.fatal_error is not None:
            return
        self.fatal_error = f"{what}: {type(error).__name__}: {error}"
        self.ready = False
        if isinstance(error, asyncio.CancelledError):
            logger.error("%s: cancelled", what)
        else:
            logger.error("%s", what, exc_info=error)
        dead = EngineDeadError(self.fatal_error)
        for add in self._adds:
            if not add.future.done():
                add.future.set_exception(dead)
        self._adds.clear()
        for call in self._calls:
            call.end(error=dead)
        self._calls.clear()
        for stream in self._streams.values():
            stream._put(dead)
        self._streams.clear()
        if self.on_fatal is not None:
            self.on_fatal(error)

    # --- requests ------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it (between two steps).
        lora_request: one of `lora_adapters`, or None for the base model.

        Raises QuireValidationError (bad input, naming the field), AdapterNotFound, EngineNotReady,
        EngineOverloaded, EngineShuttingDown or EngineDeadError."""
        arrival_time = time.time() if arrival_time is None else arrival_time
        self._check_admission()
        if request_id in self._streams:
            raise QuireValidationError("request_id",
                                       f"request_id {request_id!r} is already in use", request_id)
        future = asyncio.get_running_loop().create_future()
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self.num_requests_added += 1
        self._adds.append(_PendingAdd(request_id, prompt, params, arrival_time, future,
                                      lora_request))
        self._wake.set()
        try:
            await future
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    def _check_admission(self) -> None:
        if self.fatal_error is not None:
            raise EngineDeadError(self.fatal_error)
        if not self.accepting:
            raise EngineShuttingDown("the server is shutting down and admits no new requests")
        if self.engine is None or self.loaded is None or not self.loaded.is_set():
            raise EngineNotReady("the model is still loading")
        if self.max_queue_len is not None and self.queue_len() >= self.max_queue_len:
            raise EngineOverloaded(
                f"the server's queue is full ({self.max_queue_len} requests waiting); "
                "retry later")

    def abort(self, request_id: str) -> None:
        """Abort a request (queued, running or not yet added); a no-op once it finished."""
        if request_id not in self._streams or self.fatal_error is not None:
            return
        self._aborts.add(request_id)
        if self._wake is not None:
            self._wake.set()

    # --- LoRA adapters at runtime ---------------------------------------------------------
    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Read, check and register an adapter. Raises AdapterExists if the name is loaded or
        being loaded (of two concurrent loads of one name, one wins), ValueError naming what
        is wrong with the adapter, EngineNotReady / EngineDeadError."""
        self._check_engine()
        if getattr(self.engine, "lora", None) is None:
            raise ValueError("LoRA is off: start the server with --enable-lora")
        if name in self.lora_adapters or name in self._lora_loading:
            raise AdapterExists(f"The lora adapter '{name}' has already been loaded.")
        self._lora_loading.add(name)
        try:
            req = LoRARequest(name, self._next_lora_id, path)
            self._next_lora_id += 1
            # read and pack on a thread of its own: neither the loop nor the steps wait on it
            packed = await asyncio.to_thread(self.engine.lora.manager.read, req)
            self._check_engine()
        except BaseException:
            self._lora_loading.discard(name)
            raise

        def registered(ok: bool) -> None:  # the mirror follows the engine, caller or not
            self._lora_loading.discard(name)
            if ok:
                self.lora_adapters[name] = req

        await self._in_engine(self.engine.lora.add, req, packed, then=registered)
        return req

    async def remove_lora(self, name: str) -> LoRARequest:
        """Unregister an adapter: new requests can't ask for it, admitted ones finish with
        it. Raises AdapterNotFound."""
        self._check_engine()
        req = self.lora_adapters.pop(name, None)
        if req is None:
            raise AdapterNotFound(name)
        await self._in_engine(self.engine.remove_lora, name)
        return req

    def _check_engine(self) -> None:
        if self.fatal_error is not None:
            raise EngineDeadError(self.fatal_error)
        if self._stopping:
            raise EngineShuttingDown("the server is shutting down")
        if self.engine is None or self.loaded is None or not self.loaded.is_set():
            raise EngineNotReady("the model is still loading")

    async def _in_engine(self, fn, *args, then: Callable[[bool], None] | None = None):
        """fn(*args) on the engine's worker thread, run by the loop between two steps (the
        engine is never touched from two threads); the stats are republished after it.
        `then(ok)` runs on the loop once it ran, even if the caller was cancelled."""
        future = asyncio.get_running_loop().create_future()
        self._calls.append(_EngineCall(fn, args, future, then))
        self._wake.set()
        return await future

    # --- shutdown ------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """Stop admitting; let admitted requests finish for up to `timeout` seconds; abort
        the rest and wait (briefly) until their streams have their final outputs."""
        self.accepting = False
        self.ready = False
        deadline = time.monotonic() + timeout
        if self._streams:
            logger.info("draining: waiting up to %.0fs for %d requests", timeout,
                        len(self._streams))
        while self._streams and self.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams and self.alive:
            logger.warning("shutdown timeout: aborting %d unfinished requests",
                           len(self._streams))
            for request_id in list(self._streams):
                self.abort(request_id)
            end = time.monotonic() + 10.0
            while self._streams and self.alive and time.monotonic() < end:
                await asyncio.sleep(0.02)

    async def shutdown(self) -> None:
        """Stop the loop (aborting whatever is left) and release the worker thread."""
        self.accepting = False
        self.ready = False
        self._stopping = True
        if self._task is not None and not self._task.done():
            if not self.loaded.is_set():  # don't wait for a load to finish
                self._task.cancel()
            else:
                for request_id in list(self._streams):
                    self.abort(request_id)
                self._wake.set()
                try:
                    await asyncio.wait_for(asyncio.shield(self._task), 10.0)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    self._task.cancel()
        for call in self._calls:  # LoRA calls the stopped loop will never run
            call.end(error=EngineShuttingDown("the server is shutting down"))
        self._calls.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
