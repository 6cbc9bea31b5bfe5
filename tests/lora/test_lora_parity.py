"""Greedy output with adapters equals transformers + PEFT merged, token for token (float32),
with base and two adapters mixed in one batch, chunked prefill and prefix caching on; and the
prefix cache never shares KV blocks between adapters."""

from __future__ import annotations

import pytest
import torch

from quire import LLM, LoRARequest, SamplingParams
from quire.worker.kv_cache import bytes_per_block

from lora_helpers import MAX_NEW_TOKENS, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def make_llm(model, **kw):
    args = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                kv_cache_memory=8 << 20, max_num_batched_tokens=32, enable_prefix_caching=True)
    args.update(kw)
    return LLM(model, **args)


def lora_requests(adapters):
    return {n: LoRARequest(n, i, p) for i, (n, p) in enumerate(sorted(adapters.items()), 1)}


def test_the_adapters_change_the_output(references):
    """Else the parity below would prove nothing."""
    assert references["a"] != references[None]
    assert references["b"] != references[None]
    assert references["a"] != references["b"]


def test_mixed_batch_matches_transformers_peft_merged(tiny_llama, adapters, prompts,
                                                      references):
    """Every prompt under base, 'a' and 'b', all in one generate call (so the same prompt
    under three adapters shares steps), with 32-token chunks and prefix caching on."""
    llm = make_llm(tiny_llama)
    loras = lora_requests(adapters)
    rows = [(i, name) for name in (None, "a", "b") for i in range(len(prompts))]
    rows = rows[1::2] + rows[::2]   # interleave adapters in the waiting queue
    outs = llm.generate([prompts[i] for i, _ in rows], GREEDY, use_tqdm=False,
                        lora_request=[loras.get(name) for _, name in rows])
    for (i, name), out in zip(rows, outs):
        assert out.outputs[0].token_ids == references[name][i], \
            f"prompt {i} (length {len(prompts[i])}) under adapter {name}"
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_speculation_under_adapters_matches_transformers_peft_merged(tiny_llama, adapters,
                                                                    prompts, references):
    """The mixed batch again with n-gram speculation: verification rows carry their
    sequence's adapter like any decode (prompts said twice give the proposals a hit)."""
    llm = make_llm(tiny_llama, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})
    loras = lora_requests(adapters)
    rows = [(i, name) for name in (None, "a", "b") for i in range(len(prompts))]
    outs = llm.generate([prompts[i] for i, _ in rows], GREEDY, use_tqdm=False,
                        lora_request=[loras.get(name) for _, name in rows])
    for (i, name), out in zip(rows, outs):
        assert out.outputs[0].token_ids == references[name][i], \
            f"prompt {i} (length {len(prompts[i])}) under adapter {name}"
    assert llm.engine.speculator.counters.num_accepted_tokens > 0
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_second_run_hits_the_prefix_cache_and_still_matches(tiny_llama, adapters, prompts,
                                                            references):
    """Run twice: the second run finds its own adapter's prompt blocks cached (and only
    those), and the outputs are still the references."""
    llm = make_llm(tiny_llama)
    loras = lora_requests(adapters)
    for _ in range(2):
        for name in ("b", None, "a"):
            outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras.get(name))
            assert [o.outputs[0].token_ids for o in outs] == references[name]
    assert outs[-1].num_cached_tokens >= 96   # 'a' again: its 100-token prompt was cached


def test_same_prompt_under_two_adapters_shares_no_blocks(tiny_llama, adapters):
    llm = make_llm(tiny_llama, kv_cache_memory=16 << 20)
    loras = lora_requests(adapters)
    prompt = random_prompts(lengths=[80], seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=4)

    def cached(lora):
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0] \
            .num_cached_tokens

    assert cached(loras["a"]) == 0
    assert cached(loras["a"]) == 64        # same adapter: the prompt's full blocks are shared
    assert cached(loras["b"]) == 0         # another adapter: none
    assert cached(None) == 0               # the base model: none
    assert cached(loras["b"]) == 64
    assert cached(None) == 64
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_cache_salt_combines_with_the_adapter(tiny_llama, adapters):
    """LLM.generate(cache_salt=...): a block is shared only under the same adapter and the
    same salt; the engine's cached-free blocks count one prompt's blocks per (adapter, salt)."""
    llm = make_llm(tiny_llama, kv_cache_memory=16 << 20)
    a = lora_requests(adapters)["a"]
    prompt = random_prompts(lengths=[80], seed=13)[0]
    params = SamplingParams(temperature=0, max_tokens=4)
    pool = llm.engine.kv_manager.pool

    def cached(lora, salt):
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora,
                            cache_salt=salt)[0].num_cached_tokens

    runs = [(None, "t1"), (None, "t1"), (None, "t2"), (None, None), (a, "t1"), (a, "t1"),
            (a, None), (a, "t2")]
    assert [cached(lora, salt) for lora, salt in runs] == [0, 64, 0, 0, 0, 64, 0, 0]
    assert pool.num_used_blocks == 0
    assert pool.num_cached_free == 6 * 5  # six (adapter, salt) pairs, 5 full blocks each
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([prompt], params, use_tqdm=False, cache_salt="")
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([prompt, prompt], params, use_tqdm=False, cache_salt=["t1"])


def test_adapter_removed_and_added_again_does_not_reuse_its_old_blocks(tiny_llama, adapters):
    """A new registration (perhaps new weights at the same path) starts a new hash chain."""
    llm = make_llm(tiny_llama, kv_cache_memory=16 << 20)
    prompt = random_prompts(lengths=[40], seed=12)[0]
    params = SamplingParams(temperature=0, max_tokens=2)
    a = LoRARequest("a", 1, adapters["a"])
    llm.generate([prompt], params, use_tqdm=False, lora_request=a)
    assert llm.engine.remove_lora("a")
    assert llm.engine.add_lora(a)
    out = llm.generate([prompt], params, use_tqdm=False, lora_request=a)[0]
    assert out.num_cached_tokens == 0


@pytest.mark.parametrize("max_loras", [1, 3])
def test_scheduler_keeps_to_max_loras_and_outputs_still_match(tiny_llama, adapters, prompts,
                                                             references, max_loras):
    """With one slot, requests for 'a', 'b' and the base model interleaved: at no step do
    the running requests use more adapters than there are slots, and every output is right."""
    llm = make_llm(tiny_llama, max_loras=max_loras, max_num_batched_tokens=256)
    loras = lora_requests(adapters)
    engine = llm.engine
    seen = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        keys = {r.lora.key for r in engine.scheduler.running if r.lora is not None}
        seen.append(len(keys))
        return out

    engine.scheduler.schedule = recording_schedule
    names = ["a", None, "b", "a", "b", None]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[loras.get(n) for n in names])
    for i, (name, out) in enumerate(zip(names, outs)):
        assert out.outputs[0].token_ids == references[name][i]
    assert max(seen) == min(max_loras, 2)
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_preemption_with_adapters_still_matches(tiny_llama, adapters, prompts, references):
    """A KV cache of ten blocks: requests are preempted and recomputed, and come back with
    their own adapter."""
    block = bytes_per_block(3, 16, 2, 16, torch.float32)  # the tiny Llama, fp32
    llm = make_llm(tiny_llama, kv_cache_memory=10 * block, max_num_batched_tokens=512)
    loras = lora_requests(adapters)
    names = ["a", "b", None, "b", "a", None]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[loras.get(n) for n in names])
    for i, (name, out) in enumerate(zip(names, outs)):
        assert out.outputs[0].token_ids == references[name][i]
    assert llm.engine.scheduler.num_preemptions["recompute"] > 0
    assert llm.engine.kv_manager.pool.num_used_blocks == 0
