"""The collector paused while an engine is built (quire/collector.py): off inside, as it was
after, whether the build succeeds or fails."""

from __future__ import annotations

import gc

import pytest

from quire.collector import collector_paused
from quire.config import EngineArgs
from quire.engine import engine as engine_module
from quire.engine import factory

# imported before any test patches LLMEngine: a first import under the patch would make
# PoolingEngine subclass the stand-in for the rest of the worker's tests
from quire.pooling import engine as pooling_module


@pytest.fixture
def restore_collector():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("collecting", [True, False])
def test_a_pause_nests_and_leaves_the_collector_as_it_was(collecting, restore_collector):
    (gc.enable if collecting else gc.disable)()
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled() is collecting
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("a failed build")
    assert gc.isenabled() is collecting


@pytest.mark.parametrize("runner", ["generate", "pooling"])
@pytest.mark.parametrize("fails", [False, True])
def test_an_engine_is_built_with_the_collector_paused(runner, fails, monkeypatch,
                                                      restore_collector):
    seen = []

    class Recorder:
        def __init__(self, args, serving):
            seen.append((args.runner, gc.isenabled()))
            if fails:
                raise ValueError("the model cannot load")

    monkeypatch.setattr(engine_module, "LLMEngine", Recorder)
    monkeypatch.setattr(pooling_module, "PoolingEngine", Recorder)
    monkeypatch.setattr(factory, "engine_runner", lambda args: runner)
    gc.enable()
    if fails:
        with pytest.raises(ValueError, match="cannot load"):
            factory.create_engine(EngineArgs())
    else:
        assert isinstance(factory.create_engine(EngineArgs()), Recorder)
    assert seen == [(runner, False)] and gc.isenabled()
