"""Beam search under memory pressure (issue 18): the exact sizes that used to hang
LLM.beam_search now finish, or are refused up front with an error that says why."""

from __future__ import annotations

import pytest
import torch

from quire import LLM, BeamSearchParams
from quire.worker.kv_cache import bytes_per_block

from runtime_helpers import assert_no_blocks_in_use, random_prompts, step_limit

BS = 16
PER_BLOCK = bytes_per_block(3, BS, 2, 16, torch.float32)  # the tiny models' shape


def _llm(path, blocks, mode):
    swap = {"preemption_mode": "swap", "swap_space": 64 * PER_BLOCK} if mode == "swap" else {}
    return LLM(path, dtype="float32", kv_cache_memory=blocks * PER_BLOCK, **swap)


def _beams(llm, prompts, params):
    with step_limit(llm.engine, 2000):
        outs = llm.beam_search(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_width_2_search_in_5_blocks(mode, tiny_models):
    """5 blocks of 16 tokens, one 50-token prompt, beam width 2: with max_tokens 20 the two
    beams' own tails need 7 blocks, so it is refused at once (it used to hang); with
    max_tokens 14 they need exactly 5, and it finishes as it does in a roomy cache."""
    prompt = random_prompts(1, lengths=[50], seed=18)[0]
    llm = _llm(tiny_models["llama"], 5, mode)
    assert llm.engine.kv_manager.num_blocks == 5
    with pytest.raises(ValueError, match="beam_width x max_tokens .* 7 blocks .* has 5"):
        _beams(llm, [prompt], BeamSearchParams(beam_width=2, max_tokens=20))
    fits = BeamSearchParams(beam_width=2, max_tokens=14)
    roomy = _beams(_llm(tiny_models["llama"], 64, "recompute"), [prompt], fits)
    assert _beams(llm, [prompt], fits) == roomy
    assert_no_blocks_in_use(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_three_width_4_searches_in_16_blocks(mode, tiny_models):
    """Each search alone needs 11 of the 16 blocks; the three used to hang together (24
    blocks finished). Beam groups now run and step aside as units."""
    prompts = random_prompts(3, lengths=[50, 50, 50], seed=19)
    params = BeamSearchParams(beam_width=4, max_tokens=20)
    roomy = _beams(_llm(tiny_models["llama"], 64, "recompute"), prompts, params)
    llm = _llm(tiny_models["llama"], 16, mode)
    assert _beams(llm, prompts, params) == roomy
    assert llm.engine.scheduler.num_preemptions["recompute"] > 0, "no pressure: test is moot"
    assert_no_blocks_in_use(llm)


def test_a_search_that_slips_past_admission_fails_instead_of_hanging(tiny_models, monkeypatch):
    """The liveness guard, end to end: with the width check switched off, the 5-block search
    that used to hang now raises, names the cause, and gives every block back."""
    import quire.engine.engine as engine_module
    monkeypatch.setattr(engine_module, "num_blocks_for_beam_search", lambda *a: 0)
    prompt = random_prompts(1, lengths=[50], seed=18)[0]
    llm = _llm(tiny_models["llama"], 5, "recompute")
    with pytest.raises(RuntimeError, match="no sequence can make progress.*5 KV blocks"):
        _beams(llm, [prompt], BeamSearchParams(beam_width=2, max_tokens=20))
    assert not llm.engine.has_unfinished_requests() and not llm.engine.beams.groups
    assert_no_blocks_in_use(llm)
