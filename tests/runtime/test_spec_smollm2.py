"""Speculative decoding on the default model (SmolLM2's GGUF, float32): the greedy tokens of
every prompt are transformers' own, with n-gram and with self-draft proposals, several
sequences per step."""

from __future__ import annotations

import pytest

from quire import LLM, SamplingParams

from runtime_helpers import SMOLLM_MAX_NEW_TOKENS


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4},
    {"model": None, "num_speculative_tokens": 3},  # the default model as its own draft
], ids=["ngram", "self-draft"])
def test_smollm2_greedy_with_speculation_is_transformers(smollm_reference, spec):
    from quire.models.loader import default_model_path
    prompts, expected = smollm_reference
    if "model" in spec:
        spec = {**spec, "model": default_model_path()}
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=SMOLLM_MAX_NEW_TOKENS),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.speculator.counters.num_accepted_tokens > 0
