"""AsyncLLMEngine in-process, over a scripted stand-in for LLMEngine: one request's failure
stays its own, aborts reach the engine, and the loop's death reaches everyone."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from quire.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineNotReady,
    EngineOverloaded,
    RequestFailed,
)
from quire.engine.stats import EngineSnapshot, StepEvents
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
