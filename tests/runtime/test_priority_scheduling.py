"""Priority scheduling (issue 50): under --scheduling-policy priority a saturated engine gives
urgent requests their first token before queued less urgent ones, preempts running ones for
them when KV blocks are short, and every output stays transformers' greedy text."""

from __future__ import annotations

import pytest
import torch

from quire import LLM, SamplingParams
from quire.worker.kv_cache import bytes_per_block

from runtime_helpers import assert_no_blocks_in_use, hf_greedy, hf_model, random_prompts, step_limit

BS = 16
PER_BLOCK = bytes_per_block(3, BS, 2, 16, torch.float32)  # the tiny models' shape
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _first_token_steps(llm, batches):
    """Adds `batches` [(step, [(name, prompt, priority)])] at their steps; runs to the end.
    Returns ({name: step of its first token}, {name: token ids})."""
    engine, first, tokens, step = llm.engine, {}, {}, 0
    pending = list(batches)
    with step_limit(engine, 500):
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step:
                for name, prompt, priority in pending.pop(0)[1]:
                    engine.add_request(name, prompt, GREEDY, priority=priority)
            for out in engine.step():
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = step
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
            step += 1
    return first, tokens


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_urgent_requests_get_their_first_token_before_queued_batch_work(policy, tiny_models):
    """Two running slots, six batch requests (priority 5) queued, then two interactive ones
    (priority 0): under `priority` both interactive ones start before every batch request
    still queued; under `fcfs` (priority accepted, ignored) they wait their turn."""
    path = tiny_models["llama"]
    prompts = random_prompts(8, lengths=[20] * 8, seed=50)
    llm = LLM(path, dtype="float32", max_num_seqs=2, scheduling_policy=policy,
              kv_cache_memory=64 * PER_BLOCK)
    batch = [(f"batch{i}", prompts[i], 5) for i in range(6)]
    urgent = [(f"chat{i}", prompts[6 + i], 0) for i in range(2)]
    first, tokens = _first_token_steps(llm, [(0, batch), (1, urgent)])
    queued = [f"batch{i}" for i in range(2, 6)]  # not running when the urgent ones came
    latest_urgent = max(first["chat0"], first["chat1"])
    if policy == "priority":
        assert latest_urgent < min(first[q] for q in queued), first
    else:
        assert latest_urgent > max(first[q] for q in queued), first
    reference = hf_greedy(hf_model(path), prompts, 12)
    names = [n for n, _, _ in batch + urgent]
    assert [tokens[n] for n in names] == reference
    assert_no_blocks_in_use(llm)


def test_an_urgent_request_preempts_running_batch_work_when_kv_is_short(tiny_models):
    """Ten blocks: three 40-token batch requests fill them; an urgent one arriving later
    preempts them instead of waiting for one to finish, gets its first token in a few steps,
    and every output is still exact."""
    path = tiny_models["llama"]
    prompts = random_prompts(4, lengths=[40, 40, 40, 40], seed=51)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm = LLM(path, dtype="float32", scheduling_policy="priority",
              kv_cache_memory=10 * PER_BLOCK, enable_prefix_caching=False)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"batch{i}", prompts[i], params, priority=1)
    steps, first, tokens = 0, None, {}
    with step_limit(engine, 600):
        for _ in range(3):  # the batch requests are running and hold the cache
            engine.step()
        assert engine.kv_manager.num_free_blocks < 3
        engine.add_request("chat", prompts[3], params, priority=-1)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "chat" and first is None and out.outputs[0].token_ids:
                    first = steps
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
            steps += 1
    assert engine.scheduler.num_preemptions["recompute"] > 0
    assert first is not None and first <= 3, f"the urgent request waited {first} steps"
    reference = hf_greedy(hf_model(path), prompts, 30)
    assert [tokens[n] for n in ("batch0", "batch1", "batch2", "chat")] == reference
    assert_no_blocks_in_use(llm)


def test_llm_generate_takes_a_priority_per_prompt_and_checks_it(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", scheduling_policy="priority",
              kv_cache_memory=32 * PER_BLOCK)
    prompts = random_prompts(2, lengths=[5, 9], seed=52)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        priority=[3, -3])
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    for bad in (1.5, "high", True, 2 ** 31):
        with pytest.raises(ValueError, match="priority"):
            llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False,
                         priority=bad)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(tiny_models["llama"], dtype="float32", scheduling_policy="lifo")
    assert_no_blocks_in_use(llm)
