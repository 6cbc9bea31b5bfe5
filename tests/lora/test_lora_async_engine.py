"""AsyncLLMEngine's runtime LoRA calls on a real tiny engine: a load reads off the engine
thread (steps go on meanwhile), concurrent loads of one name have one winner, a failed load
leaves nothing behind, an adapter removed under a request lets it finish, and a request for
an adapter removed after the server picked it is refused as not found."""

from __future__ import annotations

import asyncio
import shutil
import threading

import pytest

from quire.config import EngineArgs
from quire.engine.async_engine import AdapterExists, AdapterNotFound, AsyncLLMEngine
from quire.sampling_params import RequestOutputKind, SamplingParams

from lora_helpers import edit_adapter_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
PROMPT = [5, 6, 7, 8, 9]


def run(tiny_llama, body, **engine_args):
    async def main():
        ae = AsyncLLMEngine(EngineArgs(**{
            "model": tiny_llama, "dtype": "float32", "kv_cache_memory": 8 << 20,
            "num_threads": 1, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
            "enable_prefix_caching": False, **engine_args}))
        await ae.start()
        await ae.wait_ready()
        try:
            return await body(ae)
        finally:
            await ae.shutdown()
    return asyncio.run(main())


async def tokens(stream) -> list[int]:
    return [t async for out in stream for t in out.outputs[0].token_ids]


def test_a_load_reads_off_the_engine_thread(tiny_llama, adapters):
    """The read is held until a base request has run to its end: if the load held the
    engine, that request could never finish (the wait's timeout then fails the test)."""
    base_done = threading.Event()

    async def body(ae):
        manager = ae.engine.lora.manager
        read = manager.read

        def held_read(req):
            # generous: on a cold kernel cache the base request's first step waits for the
            # native builds (~1 min on a busy 2-core host); a held engine never gets there
            assert base_done.wait(300), "the base request could not run during the load"
            return read(req)

        manager.read = held_read
        load = asyncio.ensure_future(ae.add_lora("a", adapters["a"]))
        await asyncio.sleep(0)
        out = await tokens(await ae.add_request("base", PROMPT, GREEDY))
        assert len(out) == 8
        base_done.set()
        req = await load
        assert (req.name, req.path) == ("a", adapters["a"]) and ae.lora_adapters == {"a": req}
        assert [r.name for r in ae.engine.list_loras()] == ["a"]
        with_a = await tokens(await ae.add_request("with-a", PROMPT, GREEDY, lora_request=req))
        assert with_a != out  # the adapter applies
    run(tiny_llama, body)


def test_concurrent_loads_of_one_name_and_a_failed_load(tiny_llama, adapters, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()

    async def body(ae):
        results = await asyncio.gather(*(ae.add_lora("x", adapters["b"]) for _ in range(3)),
                                       return_exceptions=True)
        assert sum(isinstance(r, AdapterExists) for r in results) == 2, results
        assert [r.name for r in results if not isinstance(r, Exception)] == ["x"]
        with pytest.raises(ValueError, match="no adapter_config.json"):
            await ae.add_lora("y", str(bad))
        assert "y" not in ae.lora_adapters and ae.engine.get_lora("y") is None
        req = await ae.add_lora("y", adapters["a"])  # the failed name is free again
        assert ae.engine.get_lora("y") == req and req.id != ae.lora_adapters["x"].id
        with pytest.raises(AdapterNotFound):
            await ae.remove_lora("z")
    run(tiny_llama, body)


def test_removed_under_a_running_request_it_finishes(tiny_llama, adapters):
    async def body(ae):
        req = await ae.add_lora("a", adapters["a"])
        reference = await tokens(await ae.add_request("ref", PROMPT, GREEDY, lora_request=req))
        stream = await ae.add_request("r", PROMPT, GREEDY, lora_request=req)
        first = await stream.__anext__()
        await ae.remove_lora("a")
        rest = await tokens(stream)
        assert list(first.outputs[0].token_ids) + rest == reference
        with pytest.raises(AdapterNotFound):  # picked before the unload, added after it
            await ae.add_request("late", PROMPT, GREEDY, lora_request=req)
        assert ae.idle and ae.engine.kv_manager.num_used_blocks == 0
        assert not ae.lora_adapters and ae.engine.list_loras() == []
    run(tiny_llama, body)


def test_a_rank_over_the_limit_names_it(tiny_llama, adapters, tmp_path):
    import shutil
    big = str(tmp_path / "big")
    shutil.copytree(adapters["a"], big)
    edit_adapter_config(big, r=32)

    async def body(ae):
        with pytest.raises(ValueError, match="max_lora_rank"):
            await ae.add_lora("big", big)
        assert ae.alive and not ae.lora_adapters
    run(tiny_llama, body)


def test_a_load_whose_caller_went_away_still_lands_in_the_mirror(tiny_llama, adapters):
    """The client of a load disconnects while the engine registers the adapter: the engine
    and `lora_adapters` (what /v1/models and request routing read) still agree."""
    started, release = threading.Event(), threading.Event()

    async def body(ae):
        lora = ae.engine.lora
        add = lora.add

        def held_add(req, packed):
            started.set()
            assert release.wait(60)
            return add(req, packed)

        lora.add = held_add
        task = asyncio.ensure_future(ae.add_lora("x", adapters["a"]))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(6000):  # bounded only against a hang
            if "x" in ae.lora_adapters:
                break
            await asyncio.sleep(0.01)
        assert ae.lora_adapters["x"] == ae.engine.get_lora("x") is not None
        assert not ae._lora_loading
        with pytest.raises(AdapterExists):
            await ae.add_lora("x", adapters["a"])
    run(tiny_llama, body)


def test_removed_under_a_waiting_request_it_still_runs_with_it(tiny_llama, adapters,
                                                               tmp_path):
    """One sequence at a time: the second request waits while the adapter is removed and
    its folder deleted, and still computes with it once scheduled (the host copy its
    request holds; the folder is never read again)."""
    folder = str(shutil.copytree(adapters["a"], tmp_path / "a"))

    async def body(ae):
        req = await ae.add_lora("a", folder)
        reference = await tokens(await ae.add_request("ref", PROMPT, GREEDY, lora_request=req))
        first = await ae.add_request("first", PROMPT, GREEDY, lora_request=req)
        second = await ae.add_request("second", PROMPT, GREEDY, lora_request=req)
        assert ae.last_snapshot.num_waiting >= 1
        await ae.remove_lora("a")
        shutil.rmtree(folder)
        assert await tokens(first) == reference
        assert await tokens(second) == reference
        assert ae.engine.kv_manager.num_used_blocks == 0 and not ae.engine.list_loras()
        manager = ae.engine.lora.manager  # the last request ended: its weights went with it
        assert not manager.refs and not manager.host and not manager.loaded_keys
    run(tiny_llama, body, max_num_seqs=1)
