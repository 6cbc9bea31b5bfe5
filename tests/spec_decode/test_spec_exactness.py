"""Greedy output with speculation is the output without it, token for token, however the
step is shaped: batches mixing sequences with and without proposals, chunked prefill, prefix
hits, preemption by recompute and by swap, n > 1, stop strings and grammars. And every KV
block comes back, after many rejections, aborts in the middle and preemptions."""

from __future__ import annotations

import pytest

from quire import SamplingParams

from runtime_helpers import assert_no_blocks_in_use, hf_greedy, hf_model
from spec_helpers import copy_heavy_prompts, engine, spec_configs

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(spec_models):
    """transformers' greedy tokens for the copy-heavy prompts (the oracle)."""
    prompts = copy_heavy_prompts()
    return prompts, hf_greedy(hf_model(spec_models["target"]), prompts, 32)


@pytest.mark.parametrize("method", ["ngram", "draft", "self-draft"])
@pytest.mark.parametrize("shape", [
    {},                                                         # one roomy step per batch
    {"max_num_batched_tokens": 48},                             # chunked prefill
    {"blocks": 40, "enable_prefix_caching": False},             # preemption by recompute
    {"blocks": 40, "preemption_mode": "swap", "swap_space": 8 << 20},
])
def test_greedy_with_speculation_is_transformers_greedy(spec_models, reference, method, shape):
    prompts, expected = reference
    llm = engine(spec_models["target"], speculative_config=spec_configs(spec_models)[method],
                 **shape)
    assert _tokens(llm, prompts) == expected
    c = llm.engine.speculator.counters
    assert c.num_drafts > 0  # the proposals were verified, not skipped
    if method != "draft":  # (the random draft is almost never right: that is its job)
        assert c.num_accepted_tokens > 0
    if "blocks" in shape:
        assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
    if shape.get("enable_prefix_caching") is False:
        assert_no_blocks_in_use(llm)


@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_prefix_hits_and_a_second_pass_give_the_same_tokens(spec_models, reference, method):
    prompts, expected = reference
    llm = engine(spec_models["target"], speculative_config=spec_configs(spec_models)[method])
    assert _tokens(llm, prompts) == expected
    hits = llm.engine.kv_manager.prefix_hits
    assert _tokens(llm, prompts) == expected  # every prompt's blocks are cached now
    assert llm.engine.kv_manager.prefix_hits > hits


def test_n_samples_stop_strings_and_max_tokens_cut_proposals(spec_models):
    prompts = copy_heavy_prompts()[-3:]
    base = engine(spec_models["target"])
    llm = engine(spec_models["target"], speculative_config=spec_configs(spec_models)["ngram"])
    for params in [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=32, n=2, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=32, min_tokens=20)]:
        assert _tokens(llm, prompts, params) == _tokens(base, prompts, params)
    # a stop string that a step's accepted tokens run past ends the text where it ends alone
    text = base.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=32, stop=[stop], ignore_eos=True)
    want = base.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
    got = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")


@pytest.mark.parametrize("method,regex,ignore_eos", [("self-draft", r"[a-z ]{4,40}\.", False),
                                                     ("ngram", r"[a-c]{3,20}", False),
                                                     ("ngram", r"[a-c]{3,20}", True)])
def test_a_grammar_keeps_its_tokens_with_speculation(spec_models, method, regex, ignore_eos):
    """The answer ends where the grammar does, token for token: a verification step's token
    after the grammar's last (EOS, the only one its mask allows) is not part of it."""
    from quire.structured.params import GuidedDecodingParams
    prompts = copy_heavy_prompts()[-6:]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=ignore_eos,
                            guided_decoding=GuidedDecodingParams(regex=regex))
    base = engine(spec_models["target"])
    llm = engine(spec_models["target"], speculative_config=spec_configs(spec_models)[method])

    def answers(e):
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                for o in e.generate(prompts, params, use_tqdm=False)]
    want, got = answers(base), answers(llm)
    assert got == want and all(finish == "stop" for _, _, finish in got)
    assert llm.engine.speculator.counters.num_accepted_tokens > 0
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_aborts_in_the_middle_of_verification_leave_no_block_behind(spec_models, method):
    llm = engine(spec_models["target"], enable_prefix_caching=False,
                 speculative_config=spec_configs(spec_models)[method])
    e = llm.engine
    prompts = copy_heavy_prompts()
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, GREEDY)
    verified = 0
    while verified < 3:  # until steps have verified proposals
        e.step()
        verified = e.speculator.counters.num_drafts
    e.abort_request([str(i) for i in range(0, len(prompts), 2)])
    while e.has_unfinished_requests():
        e.step()
    assert_no_blocks_in_use(llm)
