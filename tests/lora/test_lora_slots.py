"""Device slots and the host cache: LRU eviction, adapters of running requests pinned,
nothing read twice while cached, removal; outputs still right after evictions."""

from __future__ import annotations

import numpy as np
import pytest

import quire.lora.manager as manager_module
from quire import LLM, LoRARequest, SamplingParams

from lora_helpers import MAX_NEW_TOKENS, save_random_adapter

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
