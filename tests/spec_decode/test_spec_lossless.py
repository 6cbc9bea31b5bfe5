"""Sampling with speculation draws from the target's own distribution (the rejection
sampler's promise), checked by a chi-square test that is also shown to catch a sampler that
simply keeps the proposals. Seeded requests repeat themselves with speculation on."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from quire import SamplingParams
from quire.worker import rejection

from spec_helpers import engine, spec_configs

Z_999 = 3.0902  # the standard normal's 0.999 quantile


def _chi2_quantile_999(df: int) -> float:
    """chi2.ppf(0.999, df) by Wilson and Hilferty's cube-root normal approximation (within
    1% for df >= 3; the tests' tables have more categories than that)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + Z_999 * h ** 0.5) ** 3


def _two_sample_chi2(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int]:
    """Homogeneity of two samples' category counts (rare categories pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    cats = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    rows, rest = [], [0, 0]
    for c in cats:
        if (a[c] + b[c]) * min(na, nb) / (na + nb) >= min_expected:
            rows.append((a[c], b[c]))
        else:
            rest[0] += a[c]
            rest[1] += b[c]
    if sum(rest):
        rows.append(tuple(rest))
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows) - 1


def _rejects(a: Counter, b: Counter) -> bool:
    stat, df = _two_sample_chi2(a, b)
    return stat > _chi2_quantile_999(df)


def test_the_rejection_sampler_draws_from_the_target_distribution():
    """Unit level: fixed target distributions, proposals that are usually wrong."""
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.6, 0.1, 0.1],
                          [0.3, 0.3, 0.2, 0.1, 0.1]])
    proposals = [3, 2]  # p=0.1 at the first position: mostly rejected
    generator = torch.Generator().manual_seed(0)
    n = 20000
    first, second = Counter(), Counter()
    for _ in range(n):
        out = rejection.verify_sampled(probs, proposals, generator)
        first[out[0]] += 1
        if out[0] == proposals[0]:
            second[out[1]] += 1  # what follows an accepted proposal is p_1's
    exact_first = Counter({t: round(float(p) * n) for t, p in enumerate(probs[0])})
    assert not _rejects(first, exact_first)
    m = sum(second.values())
    assert not _rejects(second, Counter({t: round(float(p) * m) for t, p in enumerate(probs[1])}))
    # the statistic has power: a sampler that keeps the proposals is caught at once
    kept = Counter(rejection.verify_greedy([3, 2, 0], proposals)[0] for _ in range(n))
    assert _rejects(kept, exact_first)


def test_distributions_at_any_scale_are_verified_as_normalised():
    """min_p zeroes tokens without renormalising (sampling takes any scale): the verifier
    must read p(d) of the normalised row, or it under-accepts the proposal."""
    kept = torch.tensor([[0.30, 0.25, 0.20, 0.0, 0.0]])  # min_p 0.5 over .3/.25/.2/.05 x 5
    generator = torch.Generator().manual_seed(1)
    n = 20000
    first = Counter(rejection.verify_sampled(kept.repeat(2, 1), [0], generator)[0]
                    for _ in range(n))
    exact = Counter({t: round(float(p) * n) for t, p in enumerate(kept[0] / kept[0].sum())})
    assert not _rejects(first, exact)


def _second_and_third_tokens(llm, prompt, params_list) -> Counter:
    outs = llm.generate([prompt] * len(params_list), params_list, use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs)


def test_sampled_tokens_follow_the_same_distribution_with_a_draft(spec_models, monkeypatch):
    """End to end on a tiny model: the target as its own (greedy) draft is right only when the
    sample happens to be its argmax, so most steps reject. Tokens 2 and 3 (the ones verified)
    are distributed alike with and without speculation; a sampler that keeps proposals is
    told apart by the same statistic."""
    prompt = [5, 17, 300, 4000, 21, 9]
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=s)
              for s in range(1000)]
    plain = _second_and_third_tokens(engine(spec_models["target"], max_num_seqs=256), prompt,
                                     params)
    params = [p.clone(seed=p.seed + 10_000) for p in params]  # independent draws
    llm = engine(spec_models["target"], max_num_seqs=256,
                 speculative_config=spec_configs(spec_models)["self-draft"])
    with_spec = _second_and_third_tokens(llm, prompt, params)
    c = llm.engine.speculator.counters
    assert c.num_drafts > 700 and 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert not _rejects(with_spec, plain)

    def keep_proposals(probs, proposals, generator):
        return proposals + [int(torch.multinomial(probs[len(proposals)], 1, generator=generator))]
    monkeypatch.setattr("quire.worker.sampler.verify_sampled", keep_proposals)
    biased = _second_and_third_tokens(llm, prompt, params)
    assert _rejects(biased, plain)


@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_a_seeded_request_repeats_itself_with_speculation(spec_models, method):
    llm = engine(spec_models["target"], speculative_config=spec_configs(spec_models)[method])
    prompt = [5, 17, 300, 4000, 21, 9] * 4
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=7, n=2, ignore_eos=True)
    first = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    # the same request again, alone and then in a batch with others
    again = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
    batch = llm.generate([prompt, prompt[:7], prompt[3:]], params, use_tqdm=False)
    assert first == again == [c.token_ids for c in batch[0].outputs]
