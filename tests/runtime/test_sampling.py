"""Sampling: seeds repeat whatever the batch, top_k=1 is greedy, stops end generation right,
and every invalid SamplingParams field is named."""

from __future__ import annotations

import pytest

from quire import LLM, SamplingParams

from runtime_helpers import assert_no_blocks_in_use, random_prompts


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return LLM(tiny_models["llama"], dtype="float32", kv_cache_memory=4 << 20)


def _tokens(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_repeats_alone_and_in_any_batch(tiny):
    prompts = random_prompts(6, lengths=[5, 40, 9, 120, 1, 33], seed=3)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = _tokens(tiny, [prompts[0]], seeded)[0]
    assert _tokens(tiny, [prompts[0]], seeded)[0] == alone  # again
    others = [SamplingParams(temperature=0.8, max_tokens=30)] * 5  # unseeded neighbours
    in_batch = _tokens(tiny, prompts, [seeded] + others)[0]
    shuffled = _tokens(tiny, prompts[::-1], others + [seeded])[-1]
    assert in_batch == alone and shuffled == alone
    different_seed = _tokens(tiny, [prompts[0]], seeded.clone(seed=99))[0]
    assert different_seed != alone
    assert_no_blocks_in_use(tiny)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_sampling_repeats_through_preemption(tiny_models, mode):
    """A seeded sequence's generator lives with it across steps: preempted (its K/V dropped
    and recomputed, or swapped out and back), it draws on where it stopped."""
    prompts = random_prompts(6, lengths=[30, 28, 26, 24, 22, 20], seed=12)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40, n=1 + i % 2)
              for i in range(6)]
    roomy = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory=4 << 20)
    want = [[c.token_ids for c in o.outputs]
            for o in roomy.generate(prompts, params, use_tqdm=False)]
    swap = {"preemption_mode": "swap", "swap_space": 4 << 20} if mode == "swap" else {}
    tight = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory=160 << 10, **swap)
    got = [[c.token_ids for c in o.outputs]
           for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions[mode] > 0, "no pressure: test is moot"
    assert got == want
    assert_no_blocks_in_use(tight)


def test_unseeded_sampling_varies(tiny):
    prompt = random_prompts(1, lengths=[12], seed=4)
    params = SamplingParams(temperature=1.0, max_tokens=16)
    assert _tokens(tiny, prompt, params) != _tokens(tiny, prompt, params)


def test_top_k_1_equals_greedy(tiny):
    prompts = random_prompts(4, lengths=[3, 17, 64, 200], seed=5)
    greedy = _tokens(tiny, prompts, SamplingParams(temperature=0, max_tokens=20))
    top1 = _tokens(tiny, prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=20))
    assert top1 == greedy


def test_penalties_change_the_output(tiny):
    prompt = random_prompts(1, lengths=[10], seed=6)
    base = _tokens(tiny, prompt, SamplingParams(temperature=0, max_tokens=24))[0]
    assert len(set(base)) < len(base)  # this tiny model repeats itself
    penalized = _tokens(tiny, prompt, SamplingParams(temperature=0, max_tokens=24,
                                                     repetition_penalty=5.0))[0]
    assert len(set(penalized)) > len(set(base))
    freq = _tokens(tiny, prompt, SamplingParams(temperature=0, max_tokens=24,
                                                frequency_penalty=2.0, presence_penalty=2.0))[0]
    assert freq != base


def test_min_p_and_min_tokens(tiny):
    prompt = random_prompts(1, lengths=[8], seed=7)
    # min_p=1 keeps only the most likely token: greedy
    greedy = _tokens(tiny, prompt, SamplingParams(temperature=0, max_tokens=12))
    assert _tokens(tiny, prompt, SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12)) == greedy
    # a stop token sampled early is banned until min_tokens
    first = greedy[0][0]
    out = tiny.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=5,
                                               stop_token_ids=[first]), use_tqdm=False)
    ids = out[0].outputs[0].token_ids
    assert len(ids) >= 5 and first not in ids[:5]


def test_logprobs_are_top_k_and_include_the_sampled_token(tiny):
    prompt = random_prompts(1, lengths=[8], seed=8)
    out = tiny.generate(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=6, logprobs=3),
                        use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for token, step in zip(out.token_ids, out.logprobs):
        assert token in step
        ranks = sorted(lp.rank for t, lp in step.items() if t != token or lp.rank <= 3)
        assert ranks[:3] == [1, 2, 3]
        values = [lp.logprob for lp in sorted(step.values(), key=lambda lp: lp.rank)]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        total += step[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


# --- stops, on the real model (real text) ----------------------------------------------
PROMPT = "The capital of France is"


def _greedy(llm, **kw):
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, **kw),
                        use_tqdm=False)[0].outputs[0]


def test_stop_string_ends_generation_and_is_trimmed(smollm):
    full = _greedy(smollm)
    assert full.finish_reason == "length" and "\n" in full.text
    out = _greedy(smollm, stop=["\n"])
    assert out.text == full.text[: full.text.index("\n")]
    assert out.finish_reason == "stop" and out.stop_reason == "\n"
    kept = _greedy(smollm, stop=["\n"], include_stop_str_in_output=True)
    assert kept.text == full.text[: full.text.index("\n") + 1]
    assert_no_blocks_in_use(smollm)


def test_stop_string_across_a_token_boundary(smollm):
    full = _greedy(smollm)
    tok = smollm.tokenizer
    pieces = [tok.decode(full.token_ids[:i + 1]) for i in range(len(full.token_ids))]
    # the last character of token 2's text and the first of token 3's
    boundary = len(pieces[2])
    stop = full.text[boundary - 1: boundary + 1]
    assert len(tok.encode(stop, add_special_tokens=False)) >= 1
    out = _greedy(smollm, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]


def test_stop_token_ids_end_generation(smollm):
    full = _greedy(smollm)
    stop_id = full.token_ids[3]
    out = _greedy(smollm, stop_token_ids=[stop_id])
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert out.text == smollm.tokenizer.decode(out.token_ids[:-1])


def test_eos_stops_unless_ignored(smollm):
    chat = [{"role": "user", "content": "Say hi."}]
    out = smollm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == smollm.tokenizer.eos_token_id
    assert "<|im_end|>" not in c.text
    more = smollm.chat(chat, SamplingParams(temperature=0, max_tokens=len(c.token_ids) + 5,
                                            ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert more.finish_reason == "length" and len(more.token_ids) == len(c.token_ids) + 5


def test_multibyte_characters_are_never_split(smollm):
    # '你好' and emoji take several byte-level tokens each
    text = "你好, 世界! 🎉 Ça va? " * 3
    ids = smollm.tokenizer(text).input_ids
    from quire.engine.detokenizer import IncrementalDetokenizer
    detok = IncrementalDetokenizer(smollm.tokenizer, [], SamplingParams())
    seen = []
    for t in ids:
        detok.update(t)
        seen.append(detok.text)
    assert seen[-1] == text
    assert all("\ufffd" not in s for s in seen)


# --- validation --------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 1.5), ("temperature", -1), ("temperature", float("nan")),
    ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 2),
    ("repetition_penalty", 0), ("presence_penalty", 3), ("frequency_penalty", -2.5),
    ("seed", -1), ("seed", "x"), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("max_tokens", 0), ("max_tokens", -5), ("min_tokens", -1), ("logprobs", 21),
    ("logprobs", -1), ("ignore_eos", "yes"), ("skip_special_tokens", 1),
    ("include_stop_str_in_output", None),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_bad_requests_are_rejected_and_nothing_else_is_lost(tiny):
    engine = tiny.engine
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=5))
    with pytest.raises(ValueError, match="token ids") as e:
        engine.add_request("bad-ids", [5, 10**9], SamplingParams())
    assert e.value.field == "prompt"
    with pytest.raises(ValueError, match="max_tokens") as e:
        engine.add_request("too-long", [5] * 10, SamplingParams(max_tokens=10**6))
    assert e.value.field == "max_tokens"
    with pytest.raises(ValueError, match="prompt") as e:
        engine.add_request("empty", [], SamplingParams())
    assert e.value.field == "prompt"
    with pytest.raises(ValueError, match="already in use") as e:
        engine.add_request("good", [5], SamplingParams())
    assert e.value.field == "request_id"
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    done = [o for o in outs if o.finished]
    assert [o.request_id for o in done] == ["good"]
    assert len(done[0].outputs[0].token_ids) == 5
    assert_no_blocks_in_use(tiny)


def test_requests_that_could_never_run_are_rejected_up_front(tiny_models):
    """n above max_num_seqs could never be admitted and would block the queue behind it."""
    llm = LLM(tiny_models["llama"], dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"n must be <= 2 \(this engine's max_num_seqs"):
        llm.engine.add_request("big", [5, 6], SamplingParams(n=3, max_tokens=2))
    from quire import BeamSearchParams
    with pytest.raises(ValueError, match="beam_width must be <= max_num_seqs"):
        llm.engine.add_beam_search("beams", [5, 6], BeamSearchParams(beam_width=3, max_tokens=2))
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    out = llm.generate([[5, 6]], SamplingParams(n=2, seed=2**63 - 1, temperature=1.0,
                                                max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs) == 2  # the top seed works, and seed + 1 wraps
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize("penalty", [1.1754943508222875e-38, 1e30])
def test_extreme_repetition_penalties_keep_logits_finite(penalty):
    """A seen token's logit divided by a penalty near 0 (or times a huge one) saturates at
    float's largest value instead of inf; a grammar's -inf stays -inf."""
    import torch

    from quire.sampling_batch import SamplingBatch
    from quire.worker.sampler import Sampler
    sampler = Sampler(vocab_size=8, device=torch.device("cpu"), seed=0)
    logits = torch.tensor([[3.0, -2.0, 1.0, float("-inf"), 0.5, 0.0, -1.0, 2.0]])
    fields = {f: [None] for f in SamplingBatch.__dataclass_fields__
              if f not in ("bitmask", "spec_groups")}
    fields.update(penalized=[True], output_token_ids=[[0, 1, 3]], prompt_token_ids=[[2, 7]],
                  repetition_penalty=[penalty], frequency_penalty=[0.0],
                  presence_penalty=[0.0])
    out = sampler._apply_penalties(logits, SamplingBatch(**fields))
    assert not torch.isnan(out).any() and torch.isneginf(out[0, 3])
    assert torch.isfinite(out[0, [0, 1, 2, 4, 5, 6, 7]]).all()
