"""Device slots and the host cache: LRU eviction, adapters of running requests pinned,
nothing read twice while cached, removal; outputs still right after evictions. An adapter
removed (and its folder deleted) under waiting requests still serves them; one that can't be
put in a slot fails its own requests only."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import quire.lora.manager as manager_module
from quire import LLM, LoRARequest, SamplingParams

from lora_helpers import MAX_NEW_TOKENS, save_random_adapter
from runtime_helpers import assert_no_blocks_in_use, step_limit

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


@pytest.fixture()
def three(adapters, tiny_llama, tmp_path_factory):
    c = save_random_adapter(tiny_llama, str(tmp_path_factory.mktemp("c") / "c"), r=2, seed=3)
    return {"a": LoRARequest("a", 1, adapters["a"]), "b": LoRARequest("b", 2, adapters["b"]),
            "c": LoRARequest("c", 3, c)}


@pytest.fixture()
def disk_reads(monkeypatch):
    reads = []
    real = manager_module.load_peft_adapter

    def counting(name, path, max_rank):
        reads.append(name)
        return real(name, path, max_rank)

    monkeypatch.setattr(manager_module, "load_peft_adapter", counting)
    return reads


def slot_names(llm) -> list[str]:
    names = {h.key: h.name for h in llm.engine.lora.registry.by_name.values()}
    return [names.get(k, "?") for k in llm.engine.lora.manager.loaded_keys]


def test_least_recently_used_slot_and_host_copy_are_evicted(tiny_llama, three, prompts,
                                                           references, disk_reads):
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2,
              max_lora_rank=16, kv_cache_memory=8 << 20)
    manager = llm.engine.lora.manager

    def run(name):
        return llm.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=three[name])

    run("a")
    run("b")
    assert slot_names(llm) == ["a", "b"]
    run("a")                                   # a is now the most recently used
    assert slot_names(llm) == ["b", "a"]
    run("c")                                   # takes b's slot; a's host copy goes (LRU)
    assert slot_names(llm) == ["a", "c"]
    assert len(manager.host) == 2
    assert disk_reads == ["a", "b", "c"]
    outs = run("b")                            # b was still on the host: no read
    assert disk_reads == ["a", "b", "c"]
    assert slot_names(llm) == ["c", "b"]
    assert [o.outputs[0].token_ids for o in outs] == references["b"][:2]
    outs = run("a")                            # a was not: read again, still right
    assert disk_reads == ["a", "b", "c", "a"]
    assert [o.outputs[0].token_ids for o in outs] == references["a"][:2]
    assert manager.num_slot_loads == 5


def test_slots_of_running_requests_are_never_taken(tiny_llama, three):
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_cache_memory=8 << 20)
    lora = llm.engine.lora
    handles = {n: lora.resolve(r) for n, r in three.items()}
    one = np.array([1])
    lora.manager.prepare([handles["a"]], one)
    lora.manager.prepare([handles["b"]], one)
    a, b = handles["a"].key, handles["b"].key
    with pytest.raises(RuntimeError, match="all 2 LoRA slots hold adapters of running"):
        lora.manager.prepare([handles["c"]], one, in_use=frozenset({a, b}))
    lora.manager.prepare([handles["c"]], one, in_use=frozenset({a}))  # a is LRU, but pinned
    assert slot_names(llm) == ["a", "c"]


def test_a_batch_maps_each_token_to_its_adapters_slot(tiny_llama, three):
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_cache_memory=8 << 20)
    lora = llm.engine.lora
    a, b = lora.resolve(three["a"]), lora.resolve(three["b"])
    lora.manager.prepare([None, b, a, None, b], np.array([1, 1, 3, 2, 2]))
    batch = lora.manager.context.batch
    slot = {h: lora.manager.slot_use[h.key] for h in (a, b)}
    # tokens: base 0 | b 1 | a 2-4 | base 5-6 | b 7-8; segments in slot order, rows ascending
    want = sorted([(slot[b], [1, 7, 8]), (slot[a], [2, 3, 4])])
    got = [(s, batch.perm[start:end].tolist()) for s, start, end in batch.segments]
    assert got == want
    lora.manager.prepare([None, None], np.array([4, 1]))
    assert lora.manager.context.batch is None  # base-only steps skip LoRA entirely


def test_remove_lora(tiny_llama, three, prompts, references):
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_cache_memory=8 << 20, lora_modules={"a": three["a"].path})
    engine = llm.engine
    assert engine.list_loras() == [LoRARequest("a", 1, three["a"].path)]
    assert engine.get_lora("a").path == three["a"].path and engine.get_lora("zz") is None
    assert engine.add_lora(three["b"]) is True
    assert engine.add_lora(three["b"]) is False          # the same adapter again: no-op
    llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=engine.get_lora("a"))
    assert engine.remove_lora("a") is True
    assert engine.remove_lora(2) is True                 # by id
    assert engine.remove_lora("a") is False
    assert engine.list_loras() == [] and engine.lora.manager.loaded_keys == []
    assert not engine.lora.manager.host
    out = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=three["b"])
    assert out[0].outputs[0].token_ids == references["b"][0]   # added again on use


def test_removing_an_adapter_lets_its_running_requests_finish(tiny_llama, three, prompts,
                                                              references):
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16,
              kv_cache_memory=8 << 20)
    engine = llm.engine
    engine.add_request("r", prompts[3], GREEDY, lora_request=three["a"])
    engine.step()
    engine.step()
    assert engine.remove_lora("a")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done["r"].outputs[0].token_ids == references["a"][3]


def run_to_end(engine) -> dict:
    done = {}
    with step_limit(engine, 500):
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    return done


def test_removed_and_deleted_under_waiting_requests_it_still_serves_them(
        tiny_llama, adapters, prompts, references, tmp_path, disk_reads):
    """Two sequences (and one adapter) run at a time, so most requests wait while "a" is removed and
    its folder deleted: its held host copy serves them (never read again), base and 'b'
    requests in the same steps are untouched, and once the last 'a' request ends its
    weights and every KV block are gone."""
    folder = shutil.copytree(adapters["a"], tmp_path / "a")
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1,
              max_lora_rank=16, kv_cache_memory=8 << 20, max_num_seqs=2,
              enable_prefix_caching=True)
    engine, manager = llm.engine, llm.engine.lora.manager
    a, b = LoRARequest("a", 1, str(folder)), LoRARequest("b", 2, adapters["b"])
    plan = {"a0": (a, 0), "b1": (b, 1), "a2": (a, 2), "base3": (None, 3), "b4": (b, 4),
            "a5": (a, 5)}
    for rid, (lora, i) in plan.items():
        engine.add_request(rid, prompts[i], GREEDY, lora_request=lora)
    key_a = engine.lora.registry.get("a").key
    engine.step()
    assert len(engine.scheduler.waiting) == 4
    assert engine.remove_lora("a")
    shutil.rmtree(folder)
    assert key_a in manager.host and manager.refs[key_a] == 3   # held by its requests
    done = run_to_end(engine)
    for rid, (lora, i) in plan.items():
        out = done[rid]
        assert out.error is None, (rid, out.error)
        assert out.outputs[0].token_ids == references[None if lora is None else lora.name][i]
    assert disk_reads.count("a") == 1
    assert_no_blocks_in_use(llm)
    assert not manager.refs and not manager.retired
    assert key_a not in manager.host and key_a not in manager.loaded_keys
    assert engine.list_loras() == [b]


def test_an_adapter_that_cannot_enter_a_slot_fails_only_its_requests(
        tiny_llama, three, prompts, references, monkeypatch):
    """Adapter 'a' lost its host copy and can't be read: its requests (one with n=2) fail
    with an error naming it, the base and 'b' requests in the same step finish right, no
    KV block is left in use, and no prefix-cache entry of the dropped ones (registered,
    never written) serves a later request."""
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_cache_memory=8 << 20, enable_prefix_caching=True)
    engine, manager = llm.engine, llm.engine.lora.manager
    engine.add_request("a0", prompts[4], GREEDY, lora_request=three["a"])
    engine.add_request("a1", prompts[2], GREEDY.clone(n=2), lora_request=three["a"])
    engine.add_request("b2", prompts[1], GREEDY, lora_request=three["b"])
    engine.add_request("base3", prompts[3], GREEDY)
    real_read = manager.read

    def read(req):
        if req.name == "a":
            raise ValueError("its folder is gone")
        return real_read(req)

    manager.host.pop(engine.lora.registry.get("a").key)
    monkeypatch.setattr(manager, "read", read)
    first = {o.request_id: o for o in engine.step() if o.finished}
    assert set(first) == {"a0", "a1"}          # the others computed in that very step
    assert engine.scheduler.num_running_seqs == 2 and not engine.scheduler.waiting
    for out in first.values():
        assert out.finished and out.error is not None
        assert "'a'" in out.error and "its folder is gone" in out.error, out.error
        assert all(c.finish_reason == "error" for c in out.outputs)
    done = run_to_end(engine)
    assert done["b2"].outputs[0].token_ids == references["b"][1]
    assert done["base3"].outputs[0].token_ids == references[None][3]
    assert_no_blocks_in_use(llm)
    assert not manager.refs
    monkeypatch.setattr(manager, "read", real_read)
    again = llm.generate([prompts[4], prompts[2]], GREEDY, use_tqdm=False,
                         lora_request=three["a"])
    assert [o.outputs[0].token_ids for o in again] == [references["a"][4], references["a"][2]]
    assert_no_blocks_in_use(llm)
