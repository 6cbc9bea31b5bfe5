"""AsyncLLMEngine: owns one LLMEngine and gives each request an async stream of outputs.

The engine is synchronous and not thread-safe, so exactly one background task touches it:
it loads the model, then loops: it runs the commands coroutines queued (adds, aborts, LoRA
calls, shutdown: one FIFO queue, `engine_commands.py`) and `step()`, both in a single worker
thread (the event loop keeps serving while a step computes). Between steps it hands each
request's outputs to that request's stream and publishes a snapshot for metrics.

    stream = await engine.add_request(request_id, prompt, params)   # ValueError: bad input
    async for output in stream: ...                                 # one output per step
    stream.abort()                                                  # the client went away
    await engine.add_lora(name, path) / await engine.remove_lora(name)   # LoRA at runtime
    engine.state                       # LOADING, READY, DRAINING, STOPPED or DEAD
    await engine.drain(timeout); await engine.shutdown()

The lifecycle is one `EngineState` (`lifecycle.py`: the transitions and what each state
refuses): LOADING refuses with EngineNotReady, DRAINING and STOPPED with EngineShuttingDown,
DEAD with EngineDeadError.

`lora_adapters` mirrors the engine's registered adapters on the event loop, so the server
picks a request's adapter without waiting on the engine thread. An adapter is read and packed
on a thread of its own (the engine keeps stepping) and registered between two steps; a
request for an adapter removed after the server picked it fails with AdapterNotFound.

A failure inside one request ends that request's stream with `RequestFailed`; a failure of
the loop itself ends every stream with `EngineDeadError`, makes the state DEAD and calls
`on_fatal` (the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from quire.config import EngineArgs
from quire.distributed.errors import TensorParallelError
from quire.engine.async_errors import (
    AdapterExists,
    AdapterNotFound,
    EngineDeadError,
    EngineNotReady,
    EngineOverloaded,
    EngineShuttingDown,
    RequestFailed,
)
from quire.engine.engine_commands import (
    AbortRequest,
    AddRequest,
    Command,
    CommandQueue,
    EngineCall,
    Shutdown,
)
from quire.engine.lifecycle import EngineState, Lifecycle
from quire.engine.stats import EngineSnapshot, StepEvents
from quire.engine.stats_log import StatsLog
from quire.lora.request import LoRARequest
from quire.lora.stats import lora_stats
from quire.outputs import RequestOutput
from quire.sampling_params import SamplingParams
from quire.validation import QuireValidationError

__all__ = [
    "AdapterExists", "AdapterNotFound", "AsyncLLMEngine", "EngineDeadError", "EngineNotReady",
    "EngineOverloaded", "EngineShuttingDown", "EngineState", "ModelInfo", "RequestFailed",
    "RequestStream", "StatsSink",
]

logger = logging.getLogger(__name__)

IDLE_BACKOFF_MAX = 0.05  # seconds between steps that schedule nothing (work that cannot run yet)
SHUTDOWN_WAIT = 10.0     # seconds the loop gets, at shutdown, to end the aborted requests


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
    runner: str = "generate"  # or "pooling" (embeddings)
    pooler: object = None     # the pooling runner's PoolerConfig (quire/pooling/config.py)
    # a vision-language model's processor step (quire/multimodal/processor.py; None: text
    # only), and the engine's image limits (--limit-mm-per-prompt, --max-image-pixels)
    mm_processor: object = None
    max_images_per_prompt: int = 0
    max_image_pixels: int = 0


class StatsSink(Protocol):
    def bind(self, model_name: str) -> None: ...
    def record(self, snapshot: EngineSnapshot, events: StepEvents) -> None: ...
    def record_finished(self, output: RequestOutput) -> None: ...


ERROR = "error"  # a CompletionOutput's finish_reason when the engine failed its sequence


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
            if any(c.finish_reason == ERROR for c in item.outputs):
                # a sequence the engine ended with no message of its own (its grammar
                # rejected a token): the request failed, never an answer that looks done
                raise RequestFailed("a sequence of this request failed in the engine "
                                    "(finish_reason 'error'); the server log has the cause")
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs | None = None, *, engine_factory: Callable | None = None,
                 served_model_name: str | None = None, max_queue_len: int | None = None,
                 stats: StatsSink | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 freeze_gc: bool = False) -> None:
        if engine_factory is None:
            if args is None:
                raise ValueError("give EngineArgs or an engine_factory")
            from quire.engine.factory import create_engine

            def engine_factory():  # LLMEngine, or PoolingEngine for embeddings
                return create_engine(args, serving=True)
        self._factory = engine_factory
        self._served_model_name = served_model_name
        self.max_queue_len = max_queue_len
        self.stats = stats
        self.stats_log = StatsLog()  # the periodic engine line
        self.on_fatal = on_fatal
        # a server's engine: what loading made (modules, the block pool's ~300K blocks) is
        # moved out of the collector's reach once loaded (gc.freeze, as vLLM's engine does):
        # a full collection walked it all, a ~150 ms pause in whichever step it fell
        self.freeze_gc = freeze_gc

        self.engine = None          # the LLMEngine, once loaded
        self.model_info: ModelInfo | None = None  # once loaded
        self.tokenizer = None       # a copy for the server's own tokenizing threads
        self.last_snapshot: EngineSnapshot | None = None
        self.busy = False           # the worker thread is running engine code
        self.num_requests_added = 0  # lifetime count, so watchers can tell activity happened
        self.lora_adapters: dict[str, LoRARequest] = {}  # the engine's, mirrored on the loop
        self._lora_loading: set[str] = set()  # names being read or registered right now
        self._next_lora_id = 1

        self._lifecycle = Lifecycle()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "quire-engine")
        self._streams: dict[str, RequestStream] = {}
        self._commands = CommandQueue()
        self._in_flight: list[Command] = []  # taken from the queue, running in the worker
        self._task: asyncio.Task | None = None

    # --- what the server reads -----------------------------------------------------------
    @property
    def state(self) -> EngineState:
        return self._lifecycle.state

    @property
    def fatal_error(self) -> str | None:
        """Why the engine is DEAD; None in every other state."""
        return self._lifecycle.fatal_error

    @property
    def alive(self) -> bool:
        """False once the loop (or the load) has failed."""
        return self.state is not EngineState.DEAD

    @property
    def ready(self) -> bool:
        """Loaded, looping and admitting requests."""
        return self.state is EngineState.READY

    @property
    def loaded(self) -> asyncio.Event:
        """Set once the state left LOADING (loaded, failed, or shut down while loading)."""
        return self._lifecycle.left_loading

    @property
    def served_model_name(self) -> str | None:
        if self._served_model_name:
            return self._served_model_name
        return self.model_info.name if self.model_info is not None else None

    @property
    def idle(self) -> bool:
        """No request is queued, running or being added (a request has its stream from the
        moment its add is queued)."""
        return not self._streams

    def queue_len(self) -> int:
        waiting = self.last_snapshot.num_waiting if self.last_snapshot else 0
        return waiting + self._commands.count(AddRequest)

    # --- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Start loading the model and, once loaded, the engine loop; returns at once."""
        self._task = asyncio.create_task(self._main(), name="quire-engine-loop")

    async def wait_ready(self) -> None:
        """Until the load ended; raises EngineDeadError if it failed."""
        await self._lifecycle.left_loading.wait()
        if self.state is EngineState.DEAD:
            raise EngineDeadError(self.fatal_error)

    async def drain(self, timeout: float) -> None:
        """Stop admitting (DRAINING); let admitted requests finish for up to `timeout`
        seconds; abort the rest and wait (briefly) until their streams have their final
        outputs."""
        self._start_draining()
        deadline = time.monotonic() + timeout
        if self._streams:
            logger.info("draining: waiting up to %.0fs for %d requests", timeout,
                        len(self._streams))
        while self._draining_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._draining_requests():
            logger.warning("shutdown timeout: aborting %d unfinished requests",
                           len(self._streams))
            for request_id in list(self._streams):
                self.abort(request_id)
            end = time.monotonic() + 10.0
            while self._draining_requests() and time.monotonic() < end:
                await asyncio.sleep(0.02)

    async def shutdown(self) -> None:
        """Stop the loop (aborting whatever is left), then STOPPED (unless DEAD), and release
        the worker thread."""
        self._start_draining()
        task = self._task
        if task is not None and not task.done():
            if self.engine is None:  # still loading: don't wait for the load to finish
                task.cancel()
            else:
                for request_id in list(self._streams):
                    self.abort(request_id)
                self._commands.put(Shutdown())
                try:
                    await asyncio.wait_for(asyncio.shield(task), SHUTDOWN_WAIT)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    task.cancel()
        if self._lifecycle.can_move_to(EngineState.STOPPED):
            self._lifecycle.move_to(EngineState.STOPPED)
        self._fail_commands(EngineShuttingDown("the server is shutting down"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _start_draining(self) -> None:
        if self._lifecycle.can_move_to(EngineState.DRAINING):  # not when past it already
            self._lifecycle.move_to(EngineState.DRAINING)

    def _draining_requests(self) -> bool:
        return bool(self._streams) and self.state is EngineState.DRAINING

    # --- requests ------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None,
                          cache_salt: str | None = None, priority: int = 0) -> RequestStream:
        """Queue a request and wait until the engine accepted it (between two steps).
        lora_request: one of `lora_adapters`, or None for the base model. cache_salt,
        priority: see LLMEngine.add_request.

        Raises QuireValidationError (bad input, naming the field), AdapterNotFound, EngineNotReady,
        EngineOverloaded, EngineShuttingDown or EngineDeadError."""
        arrival_time = time.time() if arrival_time is None else arrival_time
        refusal = self._lifecycle.request_refusal()
        if refusal is not None:
            raise refusal
        if self.max_queue_len is not None and self.queue_len() >= self.max_queue_len:
            raise EngineOverloaded(
                f"the server's queue is full ({self.max_queue_len} requests waiting); "
                "retry later")
        if request_id in self._streams:
            raise QuireValidationError("request_id",
                                       f"request_id {request_id!r} is already in use", request_id)
        future = asyncio.get_running_loop().create_future()
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        self.num_requests_added += 1
        self._commands.put(AddRequest(request_id, prompt, params, arrival_time, lora_request,
                                      future, cache_salt, priority=priority))
        try:
            await future
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def compile_grammar(self, params) -> None:
        """The engine's compile of a request's grammar (GuidedDecodingParams), awaited: a
        grammar the tokenizer-bound compile refuses (QuireValidationError) is the caller's
        to answer before the request is added. The compile is cached, so add_request finds
        it done."""
        structured = getattr(self.engine, "structured", None)
        if structured is not None:
            await asyncio.wrap_future(structured.compiler.submit(params))

    def abort(self, request_id: str) -> None:
        """Abort a request (queued, running or not yet added); a no-op once it finished.
        It reaches the engine after every command queued before it (its add, if pending)."""
        if request_id in self._streams:
            self._commands.put(AbortRequest(request_id))

    # --- LoRA adapters at runtime ---------------------------------------------------------
    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Read, check and register an adapter. Raises AdapterExists if the name is loaded or
        being loaded (of two concurrent loads of one name, one wins), ValueError naming what
        is wrong with the adapter, EngineNotReady / EngineShuttingDown / EngineDeadError."""
        self._check_engine_call()
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
            self._check_engine_call()
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
        self._check_engine_call()
        req = self.lora_adapters.pop(name, None)
        if req is None:
            raise AdapterNotFound(name)
        await self._in_engine(self.engine.remove_lora, name)
        return req

    def _check_engine_call(self) -> None:
        refusal = self._lifecycle.call_refusal()
        if refusal is not None:
            raise refusal

    async def _in_engine(self, fn, *args, then: Callable[[bool], None] | None = None):
        """fn(*args) on the engine's worker thread, run by the loop between two steps (the
        engine is never touched from two threads); the stats are republished after it.
        `then(ok)` runs on the loop once it ran, even if the caller was cancelled."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(EngineCall(fn, args, future, then))
        return await future

    # --- the background task -------------------------------------------------------------
    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            self.engine = await loop.run_in_executor(self._executor, self._in_worker,
                                                     self._factory)
            self._describe_model()
        except asyncio.CancelledError:  # shut down while loading
            raise
        except Exception as e:  # noqa: BLE001 - a failed load is fatal, whatever it was
            self._die(e, "loading the model failed", traceback_level=logging.DEBUG)
            return
        if self.freeze_gc:
            gc.collect()  # (what loading left as garbage goes first, not into the frozen set)
            gc.freeze()
        if self.stats is not None:
            self.stats.bind(self.served_model_name)
        self._watch_workers(loop)
        self._publish_stats()
        if self.state is EngineState.LOADING:  # else a drain began while it loaded
            self._lifecycle.move_to(EngineState.READY)
        logger.info("engine ready: serving %s as %r (loaded in %.1fs)", self.engine.model_name,
                    self.served_model_name, time.perf_counter() - t0)
        try:
            await self._loop(loop)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._die(e, "the engine loop failed")

    def _watch_workers(self, loop: asyncio.AbstractEventLoop) -> None:
        """A worker's death (seen by a watcher thread) fails the engine now, idle or not: on
        the loop, not as a command, which would wait behind a step stuck in a collective with
        the dead rank (a cut link: gloo gives up only after its 120 s)."""
        workers = getattr(getattr(self.engine, "executor", None), "workers", None)
        if workers is not None:
            workers.on_death = lambda: loop.call_soon_threadsafe(self._worker_died, workers)
            if workers.dead is not None:  # died while the model loaded
                loop.call_soon(self._worker_died, workers)

    def _worker_died(self, workers) -> None:
        if workers.dead is not None:
            self._die(TensorParallelError(workers.dead), "the engine loop failed")

    def _describe_model(self) -> None:
        e = self.engine
        self.tokenizer = copy.deepcopy(e.tokenizer)
        self.model_info = ModelInfo(
            name=e.model_name, served_name=self._served_model_name or e.model_name,
            max_model_len=e.max_model_len, vocab_size=e.model_config.vocab_size,
            max_num_seqs=e.args.max_num_seqs, capacity_tokens=e.capacity_tokens,
            architecture=getattr(e.model_config, "architecture", ""),
            runner=getattr(e, "runner_type", "generate"), pooler=getattr(e, "pooler", None),
            mm_processor=getattr(e, "mm_processor", None),
            max_images_per_prompt=(getattr(e.args, "mm_limits", None) or {}).get("image", 0),
            max_image_pixels=getattr(e.args, "max_image_pixels", 0))
        loras = e.list_loras() if getattr(e, "lora", None) is not None else []
        self.lora_adapters = {r.name: r for r in loras}
        self._next_lora_id = max((r.id for r in loras), default=0) + 1

    def _in_worker(self, fn, *args):
        self.busy = True
        try:
            return fn(*args)
        finally:
            self.busy = False

    async def _loop(self, loop: asyncio.AbstractEventLoop) -> None:
        engine = self.engine
        idle_backoff = 0.0
        stopping = False  # a Shutdown command was run: end once nothing is left
        while True:
            if self._commands:
                stopping = await self._run_commands(loop) or stopping
            if engine.has_unfinished_requests():
                outputs = await loop.run_in_executor(self._executor, self._in_worker,
                                                     engine.step)
                self._dispatch(outputs)
                self._publish_stats()
                if outputs or self.last_snapshot.num_running:
                    idle_backoff = 0.0
                else:  # queued work that cannot be scheduled yet: don't spin a core on it
                    idle_backoff = min(IDLE_BACKOFF_MAX, idle_backoff * 2 or 0.001)
                    await self._commands.wait(idle_backoff)
            elif not self._commands:
                if stopping:
                    return
                await self._commands.wait()

    async def _run_commands(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Run every queued command, in order, in one trip to the worker thread; True if one
        of them was Shutdown."""
        batch = self._in_flight = self._commands.take_all()
        await loop.run_in_executor(self._executor, self._in_worker, _run_all, batch,
                                   self.engine)
        self._in_flight = []
        for command in batch:
            if isinstance(command, AddRequest) and command.error is not None:
                self._streams.pop(command.request_id, None)
            command.settle()
        self._publish_stats()
        return any(isinstance(command, Shutdown) for command in batch)

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
        self.stats_log.record(self.last_snapshot, events)

    def _die(self, error: Exception, what: str, traceback_level: int = logging.ERROR) -> None:
        """`traceback_level`: a failed load is mostly the model's or the setup's fault (a
        truncated file, a missing folder): its one line says it, its traceback is for
        --log-level debug. A failed step is a bug: its traceback goes with the error."""
        if self.state is EngineState.DEAD:
            return
        self._lifecycle.move_to(EngineState.DEAD, f"{what}: {type(error).__name__}: {error}")
        if traceback_level >= logging.ERROR:
            logger.error("%s", what, exc_info=error)
        else:
            logger.error("%s: %s: %s", what, type(error).__name__, error)
            logger.log(traceback_level, "%s: the traceback", what, exc_info=error)
        dead = EngineDeadError(self.fatal_error)
        self._fail_commands(dead)
        for stream in self._streams.values():
            stream._put(dead)
        self._streams.clear()
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _fail_commands(self, error: BaseException) -> None:
        """Fail the commands that will never run or settle: queued, or taken by a batch
        that did not come back."""
        commands, self._in_flight = self._in_flight + self._commands.take_all(), []
        for command in commands:
            command.fail(error)


def _run_all(commands: list[Command], engine) -> None:
    for command in commands:
        command.run(engine)
