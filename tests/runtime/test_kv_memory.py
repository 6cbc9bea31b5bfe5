"""KV memory: prefix caching, parallel sampling and beam search sharing blocks, swap
preemption, FP8 KV, and the accounting the metrics read."""

from __future__ import annotations

import random

import pytest
import torch

from quire import LLM, BeamSearchParams, SamplingParams
from quire.worker.kv_cache import bytes_per_block

from runtime_helpers import assert_no_blocks_in_use, hf_model, random_prompts

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _llm(path, blocks=400, **kw):
    per_block = bytes_per_block(3, BS, 2, 16, torch.float32)  # the tiny models' shape
    return LLM(path, dtype="float32", kv_cache_memory=blocks * per_block, **kw)


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _run_steps(engine, check=lambda: None):
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        check()
    return outs


def _shared_prefix_prompts(seed=0, n=10):
    rng = random.Random(seed)
    system = [rng.randrange(3, 49152) for _ in range(100)]
    return [system[: rng.choice([20, 47, 64, 100])] + [rng.randrange(3, 49152)
            for _ in range(rng.randint(1, 40))] for _ in range(n)]


# --- prefix caching ----------------------------------------------------------------------
def test_outputs_are_identical_with_prefix_caching_on_and_off(tiny_models):
    prompts = _shared_prefix_prompts()
    on, off = _llm(tiny_models["llama"]), _llm(tiny_models["llama"], enable_prefix_caching=False)
    first_on = _tokens(on, prompts)
    assert first_on == _tokens(off, prompts)
    assert _tokens(on, prompts) == first_on  # again, now from a warm cache
    snap = on.engine.snapshot()
    assert snap.prefix_hits > 0 and snap.blocks_used == 0 and snap.blocks_cached_free > 0
    assert_no_blocks_in_use(off)
    assert off.engine.snapshot().blocks_cached_free == 0


def test_a_shared_prefix_is_computed_once(tiny_models):
    rng = random.Random(1)
    prefix = [rng.randrange(3, 49152) for _ in range(200)]
    questions = [[rng.randrange(3, 49152) for _ in range(10)] for _ in range(16)]
    prompts = [prefix + q for q in questions]
    on, off = _llm(tiny_models["llama"]), _llm(tiny_models["llama"], enable_prefix_caching=False)
    assert _tokens(on, prompts) == _tokens(off, prompts)
    full_blocks = 200 // BS * BS  # 192 tokens in whole blocks; the partial one is recomputed
    assert off.engine.num_prompt_tokens_computed == 16 * 210
    assert on.engine.num_prompt_tokens_computed == 16 * 210 - 15 * full_blocks
    assert on.engine.kv_manager.prefix_hits == 15 * full_blocks
    assert on.engine.kv_manager.prefix_queries == 16 * 210


def test_cached_blocks_are_evicted_least_recently_used_first(tiny_models):
    llm = _llm(tiny_models["llama"], blocks=12)
    pool = llm.engine.kv_manager.pool
    a, b = random_prompts(2, lengths=[64, 64], seed=2)
    _tokens(llm, [a])
    _tokens(llm, [b])   # a's 4 full blocks and b's are cached, nothing in use
    assert pool.num_cached_free == 8 and pool.num_used_blocks == 0
    _tokens(llm, [a])   # touches a: b is now the least recently used
    c = random_prompts(1, lengths=[100], seed=3)[0]
    _tokens(llm, [c])   # needs 8 blocks: takes the 4 never-cached ones, then evicts b's
    hits_before = llm.engine.kv_manager.prefix_hits
    _tokens(llm, [a])
    assert llm.engine.kv_manager.prefix_hits - hits_before == 48  # a survived (3 blocks hit)


# --- parallel sampling -------------------------------------------------------------------
def test_n_samples_share_the_prompt_blocks_and_match_single_runs(tiny_models):
    llm = _llm(tiny_models["llama"], enable_prefix_caching=False)
    prompt = random_prompts(1, lengths=[72], seed=4)[0]   # 4 full blocks + 8 tokens
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12)
    engine = llm.engine
    engine.add_request("par", prompt, params)
    engine.step()  # the prompt is computed once, then forked into 4 sequences
    seqs = engine.scheduler.running
    assert len(seqs) == 4
    assert engine.kv_manager.pool.num_used_blocks == 5   # 5 blocks, one physical copy
    pool = engine.kv_manager.pool
    assert all(pool.blocks[i].ref_cnt == 4 for i in engine.kv_manager.block_ids(seqs[0]))
    engine.step()  # each writes its first token into the shared partial block: copy on write
    assert engine.kv_manager.pool.num_used_blocks == 4 + 4
    outs = _run_steps(engine)
    samples = {c.index: c.token_ids for c in outs[-1].outputs}
    assert len(samples) == 4 and len({tuple(s) for s in samples.values()}) > 1
    for i, tokens in samples.items():
        single = _tokens(llm, [prompt], params.clone(n=1, seed=7 + i))[0]
        assert tokens == single
    assert_no_blocks_in_use(llm)


# --- beam search -------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_beam_search_matches_transformers(family, tiny_models):
    prompts = random_prompts(4, lengths=[5, 17, 40, 100], seed=11)
    hf = hf_model(tiny_models[family])
    hf.generation_config.eos_token_id = None  # no beam ends early
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4,
                            do_sample=False, max_new_tokens=12, pad_token_id=0,
                            length_penalty=1.0, early_stopping=False)
            expected.append(g[0, len(p):].tolist())
    llm = _llm(tiny_models[family], enable_prefix_caching=False)
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=12,
                                                     ignore_eos=True), use_tqdm=False)
    for out, want in zip(outs, expected):
        assert out.outputs[0].token_ids == want
        scores = [c.cumulative_logprob for c in out.outputs]
        assert len(scores) == 4 and scores == sorted(scores, reverse=True)
    assert_no_blocks_in_use(llm)


def test_beams_share_their_history(tiny_models):
    llm = _llm(tiny_models["llama"], enable_prefix_caching=False)
    engine = llm.engine
    prompt = random_prompts(1, lengths=[64], seed=12)[0]  # exactly 4 blocks
    engine.add_beam_search("b", prompt, BeamSearchParams(beam_width=4, max_tokens=6))
    peak = 0

    def check():
        nonlocal peak
        peak = max(peak, engine.kv_manager.pool.num_used_blocks)
    _run_steps(engine, check)
    # 4 beams of 70 tokens held separately would need 4 x 5 blocks
    assert peak <= 4 + 4
    assert_no_blocks_in_use(llm)


def test_invalid_beam_search_params_are_named():
    for field, value in [("beam_width", 0), ("beam_width", 11), ("max_tokens", 0),
                         ("length_penalty", "x"), ("ignore_eos", 1)]:
        kwargs = {"beam_width": 2, "max_tokens": 4, field: value}
        with pytest.raises(ValueError, match=field):
            BeamSearchParams(**kwargs)


# --- preemption by swap ------------------------------------------------------------------
def test_swap_preemption_keeps_outputs_and_resumes_swapped_first(tiny_models):
    prompts = random_prompts()
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = _tokens(_llm(tiny_models["llama"]), prompts, params)
    per_block = bytes_per_block(3, BS, 2, 16, torch.float32)
    llm = _llm(tiny_models["llama"], blocks=25, preemption_mode="swap",
               swap_space=60 * per_block, enable_prefix_caching=False)
    engine, sched = llm.engine, llm.engine.scheduler
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    admitted_while_swapped, contested = [], []
    original = sched.schedule

    def schedule():
        waiting_before = set(r.request_id for r in sched.waiting)
        swapped_before = bool(sched.swapped)
        if swapped_before and waiting_before:
            contested.append(1)  # both queues hold requests: the order matters here
        out = original()
        newly = [rid for rid in out.seq_ids if rid in waiting_before]
        if swapped_before and sched.swapped and newly:
            admitted_while_swapped.append(newly)
        return out
    sched.schedule = schedule
    outs = [o for o in _run_steps(engine) if o.finished]
    got = {o.request_id: o.outputs[0].token_ids for o in outs}
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert sched.num_preemptions["swap"] > 0 and contested
    assert not admitted_while_swapped
    assert_no_blocks_in_use(llm)
    assert engine.snapshot().host_blocks_used == 0


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full(tiny_models):
    prompts = random_prompts()
    params = SamplingParams(temperature=0, max_tokens=32)
    expected = _tokens(_llm(tiny_models["llama"]), prompts, params)
    per_block = bytes_per_block(3, BS, 2, 16, torch.float32)
    llm = _llm(tiny_models["llama"], blocks=25, preemption_mode="swap", swap_space=per_block,
               enable_prefix_caching=False)
    assert _tokens(llm, prompts, params) == expected
    assert llm.engine.scheduler.num_preemptions["recompute"] > 0
    assert_no_blocks_in_use(llm)


# --- accounting --------------------------------------------------------------------------
def test_slack_never_exceeds_one_partial_block_per_sequence(tiny_models):
    llm = _llm(tiny_models["llama"], blocks=60, max_num_batched_tokens=64)
    engine = llm.engine
    for i, p in enumerate(random_prompts()):
        engine.add_request(str(i), p, SamplingParams(n=2 if i % 3 == 0 else 1, temperature=1.0,
                                                     seed=i, max_tokens=20))
    seen = []

    def check():
        snap = engine.snapshot()
        seen.append(snap)
        assert snap.slack_tokens <= snap.num_running * (BS - 1)
        assert snap.kv_usage == pytest.approx(snap.blocks_used / snap.blocks_total)
    _run_steps(engine, check)
    assert max(s.blocks_used for s in seen) > 0 and max(s.num_waiting for s in seen) > 0
    assert_no_blocks_in_use(llm)


# --- FP8 KV ------------------------------------------------------------------------------
def test_fp8_kv_cache_holds_twice_the_tokens_and_agrees_with_full_precision():
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:",
               "Once upon a time, in a small village by the sea,"]
    full = LLM(dtype="bfloat16", kv_cache_memory=32 << 20)
    fp8 = LLM(dtype="bfloat16", kv_cache_memory=32 << 20, kv_cache_dtype="fp8_e4m3")
    assert fp8.engine.capacity_tokens == 2 * full.engine.capacity_tokens
    assert fp8.engine.executor.kv_cache.kv.dtype == torch.float8_e4m3fn
    # teacher-forced: at every position of full precision's greedy continuation, fp8 is given
    # the same tokens so far and picks the next. A free-running comparison would count every
    # token after one near-tie flip as a miss (bf16 logits tie often enough to make it noise).
    outs = full.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    forced = [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids[:i]), t)
              for o in outs for i, t in enumerate(o.outputs[0].token_ids)]
    got = fp8.generate([{"prompt_token_ids": ids} for ids, _ in forced],
                       SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    agree = sum(g.outputs[0].token_ids[0] == t for g, (_, t) in zip(got, forced)) / len(forced)
    assert agree >= 0.9, agree  # 63 of 64 on SmolLM2 (float32 and bfloat16 alike)
    assert_no_blocks_in_use(fp8)



def _mapping_flags(address: int) -> str:
    """The permissions column ('rw-s', 'rw-p') of the mapping holding `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(v, 16) for v in span.split("-"))
            if lo <= address < hi:
                return perms
    raise AssertionError(f"{address:#x} is in no mapping")


def test_the_cpu_kv_cache_is_zero_pages_of_a_shared_mapping():
    # shared, not calloc's private pages: a private page read first (the zero page) costs a
    # copy-on-write fault when a token is then written there (kv_cache._zeros)
    from quire.worker.kv_cache import KVCache
    cache = KVCache(num_layers=2, num_blocks=512, block_size=16, num_kv_heads=2, head_dim=64,
                    dtype=torch.bfloat16, device=torch.device("cpu"))
    kv = cache.kv
    assert kv.data_ptr() % 64 == 0 and kv.is_contiguous()
    assert _mapping_flags(kv.data_ptr()) == "rw-s"
    assert not kv.any()   # zeros: padded gathers read unused slots
    kv[1, 1, 511] = 1.5   # read first, then written, to its last byte
    assert kv[1, 1, 511].eq(1.5).all() and kv.sum().item() == 1.5 * 16 * 2 * 64
