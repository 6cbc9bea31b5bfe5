"""AsyncLLMEngine in-process, over a scripted stand-in for LLMEngine: one request's failure
stays its own, aborts reach the engine (after the add they follow), the loop's death reaches
everyone, and each lifecycle state refuses what it should (and the probes say so)."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from types import SimpleNamespace

import pytest

from quire.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineNotReady,
    EngineOverloaded,
    EngineShuttingDown,
    EngineState,
    RequestFailed,
)
from quire.engine.stats import EngineSnapshot, StepEvents
from quire.entrypoints.routers import probes
from quire.outputs import CompletionOutput, RequestMetrics, RequestOutput
from quire.sampling_params import RequestOutputKind, SamplingParams

DELTA = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.DELTA)


class ScriptedEngine:
    """Each step gives every request one token "t"; the prompt "poison" fails its request
    (RequestOutput.error), "crash" makes step() raise, "bad" is refused by add_request.
    `max_running` requests run at once, the rest wait."""

    model_name = "scripted"
    tokenizer = None
    max_model_len = 64
    capacity_tokens = 640
    model_config = SimpleNamespace(vocab_size=100)

    def __init__(self, max_running: int = 8) -> None:
        self.max_running = max_running
        self.args = SimpleNamespace(max_num_seqs=max_running)
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.steps = 0

    def add_request(self, request_id, prompt, params, arrival_time=None):
        if prompt == "bad":
            raise ValueError("prompt is not welcome here")
        self.requests[request_id] = {"prompt": prompt, "left": params.max_tokens,
                                     "abort": False}
        return request_id

    def abort_request(self, ids):
        for rid in ids:
            if rid in self.requests:
                self.requests[rid]["abort"] = True
                self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.steps += 1
        time.sleep(0.005)
        outputs = []
        for rid in list(self.requests)[:self.max_running]:
            r = self.requests[rid]
            if r["prompt"] == "crash":
                raise RuntimeError("scheduler bug")
            if r["abort"]:
                outputs.append(_output(rid, "", "abort"))
            elif r["prompt"] == "poison":
                outputs.append(_output(rid, "", "error", error="detokenizer surprise"))
            else:
                r["left"] -= 1
                outputs.append(_output(rid, "t", "length" if r["left"] == 0 else None))
            if outputs[-1].finished:
                del self.requests[rid]
        return outputs

    def snapshot(self):
        running = min(len(self.requests), self.max_running)
        return EngineSnapshot(running, len(self.requests) - running, 0, 10, running, 0,
                              running / 10, 0, 0, 0, {}, 0, 0)

    def drain_events(self):
        return StepEvents()


def _output(rid, text, finish, error=None):
    return RequestOutput(rid, None, [1], [CompletionOutput(0, text, [7] if text else [],
                                                           finish_reason=finish)],
                         finish is not None, RequestMetrics(0.0), error=error)


def run(coro_fn, engine: ScriptedEngine, **kwargs):
    async def main():
        fatal = []
        ae = AsyncLLMEngine(engine_factory=lambda: engine, on_fatal=fatal.append, **kwargs)
        await ae.start()
        await ae.wait_ready()
        try:
            return await coro_fn(ae, fatal)
        finally:
            await ae.shutdown()
    return asyncio.run(main())


async def _until(condition, timeout: float = 30.0) -> None:
    """Poll until `condition()` holds (the timeout only bounds a hang, it is no speed test)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def _text(stream) -> str:
    return "".join([out.outputs[0].text async for out in stream])


def test_one_failing_request_fails_alone():
    async def body(ae, fatal):
        streams = [await ae.add_request(p, p, DELTA) for p in ("a", "poison", "b")]
        results = await asyncio.gather(*(_text(s) for s in streams), return_exceptions=True)
        assert results[0] == results[2] == "ttttt"
        assert isinstance(results[1], RequestFailed) and "surprise" in str(results[1])
        with pytest.raises(ValueError, match="not welcome"):
            await ae.add_request("x", "bad", DELTA)
        assert await _text(await ae.add_request("c", "c", DELTA)) == "ttttt"
        assert ae.alive and not fatal
    run(body, ScriptedEngine())


def test_abort_reaches_the_engine_and_ends_the_stream():
    engine = ScriptedEngine()

    async def body(ae, fatal):
        stream = await ae.add_request("a", "a", SamplingParams(max_tokens=1000))
        await stream.__anext__()
        stream.abort()
        stream.abort()  # twice is harmless
        await _until(lambda: not engine.requests)
        assert engine.aborted == ["a"] and not engine.requests
        # cancelled while being added: aborted too
        task = asyncio.ensure_future(ae.add_request("b", "b", SamplingParams(max_tokens=1000)))
        await asyncio.sleep(0)
        task.cancel()
        await _until(lambda: not engine.requests and "b" in engine.aborted)
        assert "b" in engine.aborted and not engine.requests
    run(body, engine)


def test_loop_death_fails_every_stream_and_is_fatal():
    async def body(ae, fatal):
        streams = [await ae.add_request(p, p, SamplingParams(max_tokens=1000))
                   for p in ("a", "b")]
        await streams[0].__anext__()
        await ae.add_request("c", "crash", DELTA)
        for s in streams:
            with pytest.raises(EngineDeadError, match="scheduler bug"):
                async for _ in s:
                    pass
        assert not ae.alive and not ae.ready and len(fatal) == 1
        with pytest.raises(EngineDeadError):
            await ae.add_request("d", "d", DELTA)
    run(body, ScriptedEngine())


def test_queue_limit_and_not_ready():
    async def body(ae, fatal):
        running = await ae.add_request("a", "a", SamplingParams(max_tokens=1000))
        waiting = await ae.add_request("b", "b", SamplingParams(max_tokens=1000))
        await running.__anext__()
        with pytest.raises(EngineOverloaded):
            await ae.add_request("c", "c", DELTA)
        running.abort()
        waiting.abort()
    run(body, ScriptedEngine(max_running=1), max_queue_len=1)

    async def not_started():
        ae = AsyncLLMEngine(engine_factory=ScriptedEngine)
        with pytest.raises(EngineNotReady):
            await ae.add_request("a", "a", DELTA)
    asyncio.run(not_started())


LONG = SamplingParams(max_tokens=1000, output_kind=RequestOutputKind.DELTA)


class HeldEngine(ScriptedEngine):
    """Records what reaches the engine, in order; while `release` is clear, a step waits in
    the worker thread (and says so with `held`), so commands queued meanwhile are run as one
    batch when it is set."""

    def __init__(self, max_running: int = 8, abort_raises: bool = False) -> None:
        super().__init__(max_running)
        self.calls: list[tuple[str, str]] = []
        self.release, self.held = threading.Event(), threading.Event()
        self.release.set()
        self.abort_raises = abort_raises

    def add_request(self, request_id, prompt, params, arrival_time=None):
        self.calls.append(("add", request_id))
        return super().add_request(request_id, prompt, params, arrival_time)

    def abort_request(self, ids):
        self.calls.extend(("abort", rid) for rid in ids)
        if self.abort_raises:
            raise RuntimeError("abort bug")
        super().abort_request(ids)

    def step(self):
        if not self.release.is_set():
            self.held.set()
            assert self.release.wait(60)
        return super().step()

    async def hold(self) -> None:
        """Until a step is waiting in the worker thread."""
        self.held.clear()
        self.release.clear()
        await _until(self.held.is_set)
        assert self.held.is_set()


async def _probes(ae) -> tuple[int, int, str | None]:
    """(/health status, /ready status, /ready's reason), as a kubelet would see them."""
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(engine=ae)))
    health, ready = await probes.health(request), await probes.ready(request)
    reason = json.loads(ready.body)["reason"] if hasattr(ready, "status_code") else None
    return (getattr(health, "status_code", 200), getattr(ready, "status_code", 200), reason)


def test_commands_reach_the_engine_in_the_order_they_were_queued():
    """An add, the abort of that request and another add, queued during one step, reach the
    engine in that order: the aborted request ends as aborted, the other runs."""
    engine = HeldEngine()

    async def body(ae, fatal):
        running = await ae.add_request("a", "a", LONG)
        await engine.hold()
        x = asyncio.ensure_future(ae.add_request("x", "x", LONG))
        await asyncio.sleep(0)  # x's add is queued
        ae.abort("x")
        y = asyncio.ensure_future(ae.add_request("y", "y", DELTA))
        await asyncio.sleep(0)
        engine.release.set()
        x_outputs = [out async for out in await x]
        assert x_outputs[-1].outputs[0].finish_reason == "abort"
        assert await _text(await y) == "ttttt"
        assert engine.calls == [("add", "a"), ("add", "x"), ("abort", "x"), ("add", "y")]
        running.abort()
    run(body, engine)


def test_an_add_in_the_batch_that_kills_the_loop_gets_engine_dead():
    engine = HeldEngine(abort_raises=True)

    async def body(ae, fatal):
        aborted = await ae.add_request("a", "a", LONG)
        running = await ae.add_request("b", "b", LONG)
        await engine.hold()
        late = asyncio.ensure_future(ae.add_request("x", "x", DELTA))
        await asyncio.sleep(0)
        aborted.abort()  # the engine's abort raises: the loop dies
        engine.release.set()
        with pytest.raises(EngineDeadError, match="abort bug"):
            await asyncio.wait_for(late, 30)  # (bounds a hang)
        with pytest.raises(EngineDeadError, match="abort bug"):
            async for _ in running:
                pass
        assert ae.state is EngineState.DEAD and len(fatal) == 1
    run(body, engine)


def test_loading_refuses_then_ready_admits_then_stopped_refuses():
    loading = threading.Event()

    def slow_load():
        assert loading.wait(60)
        return ScriptedEngine()

    async def main():
        ae = AsyncLLMEngine(engine_factory=slow_load)
        await ae.start()
        assert ae.state is EngineState.LOADING
        assert await _probes(ae) == (200, 503, "loading the model")
        with pytest.raises(EngineNotReady):
            await ae.add_request("a", "a", DELTA)
        with pytest.raises(EngineNotReady):
            await ae.add_lora("x", "/nowhere")
        loading.set()
        await ae.wait_ready()
        assert ae.state is EngineState.READY and ae.ready
        assert await _probes(ae) == (200, 200, None)
        assert await _text(await ae.add_request("a", "a", DELTA)) == "ttttt"
        await ae.shutdown()
        assert ae.state is EngineState.STOPPED and not ae.ready and ae.alive
        assert await _probes(ae) == (200, 503, "shutting down")
        with pytest.raises(EngineShuttingDown):
            await ae.add_request("b", "b", DELTA)
        with pytest.raises(EngineShuttingDown):
            await ae.add_lora("x", "/nowhere")
    asyncio.run(main())


def test_shutdown_while_loading_stops_without_waiting_for_the_load():
    never = threading.Event()

    async def main():
        ae = AsyncLLMEngine(engine_factory=lambda: never.wait(60))
        await ae.start()
        await ae.shutdown()
        assert ae.state is EngineState.STOPPED
        await ae.wait_ready()  # the wait ends; nothing failed
        with pytest.raises(EngineShuttingDown):
            await ae.add_request("a", "a", DELTA)
    asyncio.run(main())
    never.set()


def test_draining_refuses_new_work_and_lets_admitted_requests_finish():
    engine = HeldEngine()

    async def main():
        ae = AsyncLLMEngine(engine_factory=lambda: engine)
        await ae.start()
        await ae.wait_ready()
        admitted = await ae.add_request("a", "a", DELTA)
        await engine.hold()
        drain = asyncio.ensure_future(ae.drain(timeout=60))
        await asyncio.sleep(0)
        assert ae.state is EngineState.DRAINING and not ae.ready
        assert await _probes(ae) == (200, 503, "shutting down")
        with pytest.raises(EngineShuttingDown):
            await ae.add_request("b", "b", DELTA)
        with pytest.raises(EngineShuttingDown):
            await ae.add_lora("x", "/nowhere")
        engine.release.set()
        assert await _text(admitted) == "ttttt"  # ran to its end, not aborted
        await asyncio.wait_for(drain, 30)
        assert engine.aborted == [] and ae.state is EngineState.DRAINING
        await ae.shutdown()
        assert ae.state is EngineState.STOPPED
    asyncio.run(main())


def test_drain_past_its_timeout_aborts_what_is_left():
    engine = ScriptedEngine()

    async def body(ae, fatal):
        stream = await ae.add_request("a", "a", LONG)
        await ae.drain(timeout=0)
        outputs = [out async for out in stream]
        assert outputs[-1].outputs[0].finish_reason == "abort"
        assert engine.aborted == ["a"] and ae.idle
    run(body, engine)


def test_dead_refuses_everything_and_stays_dead_after_shutdown():
    async def main():
        fatal = []
        ae = AsyncLLMEngine(engine_factory=ScriptedEngine, on_fatal=fatal.append)
        await ae.start()
        await ae.wait_ready()
        await ae.add_request("c", "crash", DELTA)
        await _until(lambda: ae.state is EngineState.DEAD)
        health, ready, reason = await _probes(ae)
        assert (health, ready) == (503, 503) and "scheduler bug" in reason
        with pytest.raises(EngineDeadError, match="scheduler bug"):
            await ae.add_request("d", "d", DELTA)
        with pytest.raises(EngineDeadError, match="scheduler bug"):
            await ae.add_lora("x", "/nowhere")
        await ae.shutdown()
        assert ae.state is EngineState.DEAD and "scheduler bug" in ae.fatal_error
        assert len(fatal) == 1
    asyncio.run(main())


def test_a_failed_load_is_dead():
    def broken():
        raise OSError("no such model")

    async def main():
        fatal = []
        ae = AsyncLLMEngine(engine_factory=broken, on_fatal=fatal.append)
        await ae.start()
        with pytest.raises(EngineDeadError, match="loading the model failed.*no such model"):
            await ae.wait_ready()
        assert ae.state is EngineState.DEAD and len(fatal) == 1
        assert (await _probes(ae))[:2] == (503, 503)
        await ae.shutdown()
        assert ae.state is EngineState.DEAD
    asyncio.run(main())


@pytest.mark.parametrize("freeze", [False, True])
def test_a_servers_engine_moves_what_loading_made_out_of_the_collectors_reach(freeze):
    """freeze_gc (quire serve's engine): once loaded, the objects loading made are frozen, so
    a full collection no longer walks them; a library engine leaves the collector alone."""
    made = []

    def load():
        made.extend([object()] for _ in range(50_000))  # tracked containers, like KV blocks
        return ScriptedEngine()

    async def main():
        ae = AsyncLLMEngine(engine_factory=load, freeze_gc=freeze)
        await ae.start()
        await ae.wait_ready()
        frozen = gc.get_freeze_count()
        await ae.shutdown()
        return frozen

    harness_froze = gc.get_freeze_count() > 0  # (tests/conftest.py freezes the modules)
    gc.unfreeze()
    try:
        frozen = asyncio.run(main())
        assert (frozen >= len(made)) if freeze else frozen == 0
    finally:
        gc.unfreeze()
        made.clear()
        if harness_froze:
            gc.collect()
            gc.freeze()
