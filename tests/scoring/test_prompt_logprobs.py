"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers float32 on a tiny
random Llama: every prompt position's logprob, rank and top-k, whole or in prefill chunks, and
after a prefix-cache hit on a shared prefix (recomputed, not lost)."""

from __future__ import annotations

import pytest
import torch

from quire import LLM, SamplingParams
from quire.validation import QuireValidationError

from runtime_helpers import (
    assert_no_blocks_in_use,
    hf_model,
    random_prompts,
    save_tiny_model,
    smollm2_tokenizer,
    tiny_config,
)

TOL = 1e-4
K = 3


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("scoring") / "llama")
    return save_tiny_model(path, tiny_config("llama"), smollm2_tokenizer())


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """prompt -> transformers' float32 log-softmax at each position [len, vocab]."""
    model = hf_model(tiny_llama)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return logprobs


def _check(out, prompt, ref: torch.Tensor) -> None:
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for pos in range(1, len(prompt)):
        row, token, entry = ref[pos - 1], prompt[pos], lps[pos]
        assert abs(entry[token].logprob - row[token].item()) < TOL, pos
        # the rank counts tokens above it: those within TOL may fall either side
        target = row[token].item()
        assert int((row > target + TOL).sum()) + 1 <= entry[token].rank \
            <= int((row > target - TOL).sum()) + 1
        top = row.topk(K)
        ranked = sorted((lp for lp in entry.values() if lp.rank <= K), key=lambda lp: lp.rank)
        assert len(entry) in (K, K + 1)
        assert [lp.rank for lp in ranked] == list(range(1, K + 1))
        for lp, value in zip(ranked, top.values.tolist()):
            assert abs(lp.logprob - value) < TOL
        top_ids = {t for t, lp in entry.items() if lp.rank <= K}
        assert top_ids == set(top.indices.tolist())
        assert all(lp.decoded_token is not None for lp in entry.values())


@pytest.mark.parametrize("budget", [2048, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(tiny_llama, reference, budget):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=8 << 20,
              max_num_batched_tokens=budget)
    prompts = random_prompts(lengths=[1, 2, 17, 64, 150])
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        _check(out, prompt, reference(prompt))
    assert_no_blocks_in_use(llm)


def test_prompt_logprobs_survive_a_prefix_cache_hit(tiny_llama, reference):
    """The second prompt shares the first's 64-token prefix, which is in the prefix cache:
    its positions are recomputed, so every prompt logprob is there and right."""
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=8 << 20,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    shared = random_prompts(lengths=[64], seed=3)[0]
    first, second = shared + [5, 6, 7], shared + [8, 9, 10, 11]
    plain = SamplingParams(temperature=0, max_tokens=1)
    warm = llm.generate([first], plain, use_tqdm=False)[0]
    hit = llm.generate([second], plain, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0 and hit.num_cached_tokens >= 48  # the cache works
    out = llm.generate([second], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=K),
                       use_tqdm=False)[0]
    _check(out, second, reference(second))
    # the output token is the same as without prompt logprobs
    assert out.outputs[0].token_ids == hit.outputs[0].token_ids


def test_prompt_logprobs_with_n_samples_and_output_logprobs(tiny_llama, reference):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=8 << 20)
    prompt = random_prompts(lengths=[20], seed=5)[0]
    out = llm.generate([prompt], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3,
                                                logprobs=2, prompt_logprobs=K),
                       use_tqdm=False)[0]
    _check(out, prompt, reference(prompt))
    assert len(out.outputs) == 2 and all(len(c.logprobs) == 3 for c in out.outputs)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, "3"])
def test_bad_prompt_logprobs_name_the_field(bad):
    with pytest.raises(QuireValidationError) as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.field == "prompt_logprobs"
