"""speculative_config takes vLLM's keys; a bad one is one error naming it, from the library,
the CLI and the server alike; what speculation can't serve is refused, not ignored. The
acceptance counters reach the metrics (vLLM's names too) and the periodic log line."""

from __future__ import annotations

import json

import pytest

from quire import LLM, BeamSearchParams, SamplingParams
from quire.engine.stats import EngineSnapshot
from quire.engine.stats_log import StatsLog
from quire.metrics import ServerMetrics
from quire.speculative_config import SpeculativeConfig
from quire.validation import QuireValidationError

from runtime_helpers import save_tiny_model, smollm2_tokenizer, tiny_config
from spec_helpers import NGRAM, copy_heavy_prompts, engine, spec_configs


@pytest.mark.parametrize("config, names", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup"),
    ({"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo_key": 1}, "typo_key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_min_acceptance": 2},
     "adaptive_min_acceptance"),
    ("{not json", "JSON"),
    ("[1, 2]", "JSON object"),
])
def test_bad_values_are_one_error_naming_the_key(config, names):
    with pytest.raises(QuireValidationError) as e:
        SpeculativeConfig.parse(config)
    assert e.value.field == "speculative_config" and names in str(e.value)


def test_vllms_defaults_and_spellings():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}) == \
        SpeculativeConfig("ngram", 3, 5, 5)
    c = SpeculativeConfig.parse(json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 4}))
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 2}).method == \
        "draft_model"


def test_the_cli_takes_vllms_flag_and_names_it_when_wrong():
    import argparse

    from quire.entrypoints.engine_args import add_engine_flags, engine_args_from
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    ns = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert SpeculativeConfig.parse(engine_args_from(ns, None).speculative_config).method == "ngram"
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram"}'])
    with pytest.raises(ValueError, match="--speculative-config.*num_speculative_tokens"):
        engine_args_from(ns, None)


def test_a_draft_with_another_vocabulary_is_refused(spec_models, tmp_path):
    other = save_tiny_model(str(tmp_path / "other"), tiny_config("llama", vocab_size=49153),
                            smollm2_tokenizer())
    with pytest.raises(QuireValidationError, match="must share the target's vocabulary") as e:
        engine(spec_models["target"], speculative_config={"model": other,
                                                          "num_speculative_tokens": 2})
    assert e.value.field == "speculative_config.model"


def test_beam_search_refuses_a_speculative_engine(spec_models):
    llm = engine(spec_models["target"], speculative_config=NGRAM)
    with pytest.raises(QuireValidationError, match="beam search") as e:
        llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert e.value.field == "speculative_config"


def test_penalties_and_logprobs_decode_without_proposals(spec_models):
    llm: LLM = engine(spec_models["target"], speculative_config=spec_configs(spec_models)["self-draft"])
    prompts = copy_heavy_prompts()[-2:]
    for params in [SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3),
                   SamplingParams(temperature=0, max_tokens=8, logprobs=2)]:
        out = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    assert llm.engine.speculator.counters.num_drafts == 0


def test_counters_reach_the_metrics_and_the_log_line(spec_models):
    llm = engine(spec_models["target"], speculative_config=spec_configs(spec_models)["self-draft"])
    llm.generate(copy_heavy_prompts()[:4], SamplingParams(temperature=0, max_tokens=12),
                 use_tqdm=False)
    events = llm.engine.drain_events()
    assert events.spec_draft_tokens > 0 and events.spec_accepted_tokens > 0
    assert sum(events.spec_accepted_per_position) == events.spec_accepted_tokens
    metrics = ServerMetrics(compat="vllm")
    metrics.bind("m")
    snap = llm.engine.snapshot()
    metrics.record(snap, events)
    text = metrics.render().decode()
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        for prefix in ("quire:", "vllm:"):
            assert f"{prefix}{name}{{" in text, prefix + name
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' \
        in text
    line = StatsLog(interval=0.0).record(snap, events)
    assert "speculative acceptance 100.0%" in line  # the target as its own draft
    assert StatsLog(interval=0.0).record(
        EngineSnapshot(0, 0, 0, 1, 0, 0, 0.0, 0, 0, 0, {}, 0, 0), llm.engine.drain_events()) \
        is None  # an idle engine logs nothing
