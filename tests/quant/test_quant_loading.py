"""--quantization and the GGUF conversion cache: each quantization reads the folder made for
it (never a float one for a quantized run or the reverse), and bad values are named."""

from __future__ import annotations

import json
import os

import pytest

from quire.config import EngineArgs
from quire.layers.quantization import CheckpointQuantConfig, QuantizeOnLoadConfig
from quire.models import loader
from quire.models.loader import ModelSource


@pytest.fixture
def fake_conversion(tmp_path, monkeypatch):
    """materialize() with the slow conversion replaced by a stub that records what it was
    asked to write (float or the file's blocks)."""
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def convert(source, folder, blocks=False, sibling=None):
        import torch
        from safetensors.torch import save_file
        calls.append(blocks)
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"]}, f)
        save_file({"w": torch.zeros(4, 4)}, os.path.join(folder, "model.safetensors"))
        if blocks:
            with open(os.path.join(folder, loader.QUANT_MANIFEST), "w") as f:
                json.dump({"layers": {"layers.0.qkv_proj": {"method": "int4",
                                                            "group_size": 32}}}, f)
        open(os.path.join(folder, ".complete"), "w").close()

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    return ModelSource("gguf", str(gguf), "m"), calls


def test_cache_folder_keys_on_the_quantization(fake_conversion):
    source, calls = fake_conversion
    auto = loader.materialize(source, "auto")
    none = loader.materialize(source, "none")
    assert auto.path != none.path and calls == [True, False]
    # int8/int4 start from the float values: they share the float folder, made once
    assert loader.materialize(source, "int8").path == none.path
    assert loader.materialize(source, "auto").path == auto.path and calls == [True, False]
    assert isinstance(loader.quant_config(auto, "auto", 32), CheckpointQuantConfig)
    assert loader.quant_config(none, "auto", 32).name == "none"
    assert isinstance(loader.quant_config(none, "int4", 64), QuantizeOnLoadConfig)


def test_a_float_folder_made_by_an_older_quire_is_not_read_as_quantized(fake_conversion):
    source, calls = fake_conversion
    none = loader.materialize(source, "none")
    assert loader.quant_manifest(none, "auto") is None  # float folder: no manifest
    auto = loader.materialize(source, "auto")
    assert calls == [False, True] and auto.path != none.path


def test_quantized_folder_refuses_a_float_or_requantized_run(fake_conversion):
    source, _ = fake_conversion
    auto = loader.materialize(source, "auto")
    for q in ("none", "int8"):
        with pytest.raises(ValueError, match="holds quantized weights.*quantization='auto'"):
            loader.quant_config(auto, q, 32)


def test_a_changed_gguf_drops_the_folders_of_its_old_copy_and_nothing_else(fake_conversion,
                                                                         tmp_path):
    """A reinstall (same path, new mtime) makes new folders; a conversion then removes the
    ones made from the old file, and orphaned temporary folders, but keeps another file's
    folders, folders with no record of their source, and a conversion still in progress."""
    import subprocess

    from quire.models import conversion_cache
    source, calls = fake_conversion
    old_none, old_auto = (loader.materialize(source, q).path for q in ("none", "auto"))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"yy")
    other_none = loader.materialize(ModelSource("gguf", str(other), "other"), "none").path
    cache = os.path.dirname(old_none)
    legacy = os.path.join(cache, "legacy-0123456789abcdef")
    os.makedirs(legacy)
    open(os.path.join(legacy, ".complete"), "w").close()
    dead = subprocess.Popen(["true"])  # a pid that no longer runs once waited for
    dead.wait()
    orphan = os.path.join(cache, f"m-0123.tmp-{dead.pid}")
    live = os.path.join(cache, f"m-4567.tmp-{os.getpid()}")
    os.makedirs(orphan)
    os.makedirs(live)
    for folder in (old_none, old_auto, other_none):
        with open(os.path.join(folder, conversion_cache.SOURCE_RECORD)) as f:
            assert json.load(f)["path"] == os.path.abspath(
                str(other) if folder == other_none else source.path)

    st = os.stat(source.path)  # the package reinstalled: the same file, a new mtime
    os.utime(source.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    new_none = loader.materialize(source, "none").path
    assert new_none != old_none and calls == [False, True, False, False]
    for gone in (old_none, old_auto, orphan):
        assert not os.path.exists(gone), gone
    for kept in (new_none, other_none, legacy, live):
        assert os.path.isdir(kept), kept
    # a hit converts nothing and removes nothing, even with the other file gone
    other.unlink()
    assert loader.materialize(source, "none").path == new_none and len(calls) == 4
    assert os.path.isdir(other_none)


def test_a_folder_without_a_record_gets_one_when_it_is_read(fake_conversion):
    from quire.models import conversion_cache
    source, _ = fake_conversion
    folder = loader.materialize(source, "none").path
    record = os.path.join(folder, conversion_cache.SOURCE_RECORD)
    os.remove(record)  # as an older Quire left it
    assert loader.materialize(source, "none").path == folder
    with open(record) as f:
        assert json.load(f)["size"] == os.path.getsize(source.path)


@pytest.mark.parametrize("damage", ["truncate", "remove weights", "remove config"])
def test_a_damaged_folder_is_made_again_from_the_gguf(fake_conversion, damage, caplog):
    """The folder is only a faster copy of the GGUF: one whose weights file is cut short or
    missing (a disk filled by something else, a partial copy of the cache) is converted
    again, with a warning, instead of failing every start."""
    import logging
    source, calls = fake_conversion
    folder = loader.materialize(source, "none").path
    weights = os.path.join(folder, "model.safetensors")
    if damage == "truncate":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) - 1)
    else:
        os.remove(weights if damage == "remove weights" else os.path.join(folder, "config.json"))
    with caplog.at_level(logging.WARNING, logger="quire.models.loader"):
        assert loader.materialize(source, "none").path == folder
    assert calls == [False, False] and "is damaged" in caplog.text
    from quire.models import conversion_cache
    assert conversion_cache.intact(folder)


def test_housekeeping_never_fails_a_load(fake_conversion, monkeypatch):
    """A cache it cannot list or a record it cannot parse is left alone."""
    from quire.models import conversion_cache
    source, _ = fake_conversion
    folder = loader.materialize(source, "none").path
    with open(os.path.join(folder, conversion_cache.SOURCE_RECORD), "w") as f:
        f.write("{not json")
    assert conversion_cache.collect_stale(os.path.dirname(folder), keep="/nowhere") == []
    assert conversion_cache.collect_stale("/nonexistent/cache", keep="/nowhere") == []
    assert os.path.isdir(folder)


@pytest.mark.parametrize("field,value,message", [
    ("quantization", "int3", "quantization must be one of auto, none, int8, int4"),
    ("quantization_group_size", 48, "quantization_group_size must be one of 32, 64, 128"),
])
def test_bad_quantization_args_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**{field: value})


def test_quantization_flags_reach_engine_args():
    import argparse

    from quire.entrypoints.engine_args import add_engine_flags, engine_args_from
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    ns = parser.parse_args(["--quantization", "int4", "--quantization-group-size", "64"])
    args = engine_args_from(ns, None)
    assert (args.quantization, args.quantization_group_size) == ("int4", 64)
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "fp4"])


@pytest.mark.parametrize("quantization", ["int4", "none"])
def test_each_decoder_linear_is_processed_as_soon_as_its_weights_are_in(tiny_llama,
                                                                         quantization):
    """A float checkpoint quantized on load never sits whole in memory: each decoder linear
    is quantized (and its float weight dropped) right after its last tensor arrives, before
    the next layer's tensors are read."""
    import torch

    from quire import LLM
    from quire.layers.linear import LinearBase
    from quire.models import llama

    events = []
    read = loader._iter_safetensors

    def logged_read(folder):
        for name, tensor in read(folder):
            events.append(("read", name))
            yield name, tensor

    process = LinearBase.process_weights_after_loading

    def logged_process(self):
        if not self.weights_processed:
            events.append(("process", self.prefix))
        process(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(loader, "_iter_safetensors", logged_read)
    mp.setattr(LinearBase, "process_weights_after_loading", logged_process)
    try:
        llm = LLM(tiny_llama, dtype="float32", quantization=quantization,
                  kv_cache_memory=16 << 20)
    finally:
        mp.undo()
    model = llm.engine.executor.model
    assert isinstance(model, llama.LlamaForCausalLM)
    reads = [name for kind, name in events if kind == "read"]
    for layer in range(len(model.layers)):
        for linear, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                              ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
                              ("self_attn.o_proj", ("o_proj",)), ("mlp.down_proj", ("down_proj",))):
            at = events.index(("process", f"layers.{layer}.{linear.split('.')[1]}"))
            last = max(events.index(("read", n)) for n in reads
                       if n.startswith(f"model.layers.{layer}.") and n.split(".")[-2] in parts)
            assert at == last + 1, (layer, linear, events[last:at + 1])
    if quantization == "int4":
        qkv = model.layers[0].qkv_proj
        assert not hasattr(qkv, "weight") and qkv.qweight.dtype == torch.uint8
    assert llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
