"""Guided decoding in the engine, on a tiny random Llama: its logits are noise, so only the
grammar masks make its output valid. Every output must parse under sampling, n > 1, beam
search, preemption, prefix caching, chunked prefill and streaming; no KV block may leak."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from quire import LLM, SamplingParams
from quire.engine.beam_search import BeamSearchParams
from quire.engine.engine import LLMEngine
from quire.sampling_params import RequestOutputKind
from quire.structured import GuidedDecodingParams
from quire.structured.compiler import GrammarCompiler

from runtime_helpers import assert_no_blocks_in_use, save_tiny_model, tiny_config

# nested, and bounded everywhere, so a random model always finishes within max_tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "b", "c"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "email": {"type": ["string", "null"], "maxLength": 6}},
                  "required": ["age", "email"], "additionalProperties": False},
    },
    "required": ["id", "name", "ok", "kind", "tags", "owner"],
    "additionalProperties": False,
}
MAX_TOKENS = 200
WORDS = "the a river stone blue quick seven json tool city north ocean paper".split()


def text_prompts(n: int, lengths, seed: int) -> list[str]:
    """Prompts that are whole words: a random token-id prompt may end inside a UTF-8
    character, and the detokenizer then shows that prompt tail at the front of the output."""
    import random
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(length)) for length in lengths[:n]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm_tokenizer):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_structured")), tiny_config("llama"),
                           smollm_tokenizer)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20)


def _json_params(seed, **kw):
    return SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed,
                          guided_decoding=GuidedDecodingParams(json=SCHEMA), **kw)


def _assert_valid(completion):
    assert completion.finish_reason == "stop", completion
    jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_json_schema_output_validates_for_many_seeds(llm):
    prompts = text_prompts(24, [3 + i % 7 for i in range(24)], seed=1)
    outs = llm.generate(prompts, [_json_params(s) for s in range(24)], use_tqdm=False)
    texts = set()
    for out in outs:
        _assert_valid(out.outputs[0])
        texts.add(out.outputs[0].text)
    assert len(texts) > 12  # sampling still samples: the mask only removes invalid tokens
    assert_no_blocks_in_use(llm)


def test_each_of_n_samples_follows_its_own_grammar(llm):
    outs = llm.generate(text_prompts(3, [5, 17, 40], seed=2),
                        _json_params(7, n=4), use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == 4
        for c in out.outputs:
            _assert_valid(c)
        assert len({c.text for c in out.outputs}) > 1
    assert_no_blocks_in_use(llm)


def test_greedy_grammar_output_is_batch_invariant(llm):
    prompts = text_prompts(6, [4, 9, 16, 33, 64, 100], seed=3)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                            guided_decoding=GuidedDecodingParams(json=SCHEMA))
    together = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in prompts]
    assert together == alone
    for text in together:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("kind, spec, check", [
    ("regex", r"[a-z]{2,5}-[0-9]{2}", lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", t)),
    ("choice", ["red", "green", "blue sky"], lambda t: t in ("red", "green", "blue sky")),
    ("grammar", 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/\n',
     lambda t: re.fullmatch(r"\([0-9](\+[0-9])*\)", t)),
    ("grammar", 'root ::= "yes" | "no" | "maybe"', lambda t: t in ("yes", "no", "maybe")),
    ("json_object", True, lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_and_json_object(llm, kind, spec, check):
    guided = GuidedDecodingParams(**{kind: spec})
    outs = llm.generate(text_prompts(8, [2] * 8, seed=4),
                        [SamplingParams(temperature=1.0, seed=s,
                                        max_tokens=48 if kind == "json_object" else MAX_TOKENS,
                                        guided_decoding=guided) for s in range(8)],
                        use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        if kind == "json_object" and c.finish_reason == "length":
            continue  # any JSON object may be long; its prefix is still checked by the grammar
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_beam_search_beams_follow_the_grammar(llm):
    pattern = r"[a-z]{3,6}(_[0-9])?"
    params = BeamSearchParams(beam_width=3, max_tokens=12,
                              guided_decoding=GuidedDecodingParams(regex=pattern))
    outs = llm.beam_search(text_prompts(3, [4, 10, 30], seed=5), params,
                           use_tqdm=False)
    for out in outs:
        assert len(out.outputs) == 3
        for c in out.outputs:
            assert re.fullmatch(pattern, c.text), c.text
    assert_no_blocks_in_use(llm)


def test_preemption_by_recompute_keeps_grammars_in_step(tiny_llama):
    # ~40 blocks of 16 tokens: 16 requests of ~100 tokens each can't all fit
    small = LLM(tiny_llama, dtype="float32", kv_cache_memory=40 * 12288, block_size=16)
    outs = small.generate(text_prompts(16, [30] * 16, seed=6),
                          [_json_params(s) for s in range(16)], use_tqdm=False)
    assert small.engine.scheduler.num_preemptions["recompute"] > 0
    for out in outs:
        _assert_valid(out.outputs[0])
    assert_no_blocks_in_use(small)


def test_prefix_caching_and_chunked_prefill(tiny_llama):
    cached = LLM(tiny_llama, dtype="float32", kv_cache_memory=16 << 20,
                 enable_prefix_caching=True, max_num_batched_tokens=48)
    shared = text_prompts(1, [160], seed=7)[0]
    prompts = [shared + f" {w}" for w in WORDS[:6]]
    for round_ in range(2):
        outs = cached.generate(prompts, [_json_params(10 * round_ + s) for s in range(6)],
                               use_tqdm=False)
        for out in outs:
            _assert_valid(out.outputs[0])
    assert cached.engine.kv_manager.prefix_hits > 0


def test_streamed_deltas_concatenate_to_valid_json(tiny_llama):
    engine = LLMEngine.from_kwargs(model=tiny_llama, dtype="float32", kv_cache_memory=16 << 20)
    params = _json_params(3, n=2, output_kind=RequestOutputKind.DELTA)
    engine.add_request("r", [5, 6, 7], params)
    texts, finished = {0: "", 1: ""}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                texts[c.index] += c.text
            finished = finished or out.finished
    assert finished
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)
    events = engine.drain_events()
    assert events.structured_requests == 1
    assert events.grammar_mask_time and all(t >= 0 for t in events.grammar_mask_time)
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_grammar_requests_mix_with_free_ones(llm):
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(text_prompts(4, [3, 4, 5, 6], seed=8),
                        [free, _json_params(1), free, _json_params(2)], use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 8 and len(outs[2].outputs[0].token_ids) == 8
    _assert_valid(outs[1].outputs[0])
    _assert_valid(outs[3].outputs[0])


@pytest.mark.parametrize("kwargs, words", [
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"json": {"type": "objekt"}}, "objekt"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"choice": []}, "choice"),
    ({"grammar": "start: undefined_rule\n"}, "undefined_rule"),
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
])
def test_invalid_guided_decoding_names_what_is_wrong(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        GuidedDecodingParams(**kwargs)


def test_guided_decoding_must_be_guided_decoding_params():
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(guided_decoding={"json": {}})


def test_compiled_grammar_cache_is_bounded_and_shared():
    compiled = []

    class FakeBackend:
        def compile(self, params):
            compiled.append(params.key)
            return params.key

    compiler = GrammarCompiler(FakeBackend, cache_size=2)
    a, b, c = (GuidedDecodingParams(regex=r) for r in ("a", "b", "c"))
    fa = compiler.submit(a)
    assert compiler.submit(GuidedDecodingParams(regex="a")) is fa  # same schema, one compile
    compiler.submit(b).result()
    compiler.submit(c).result()
    assert len(compiler) == 2
    compiler.submit(a).result()  # evicted: compiled again
    assert compiled.count(a.key) == 2
    compiler.shutdown()


def test_request_waits_for_its_grammar_while_others_run(tiny_llama):
    import threading
    engine = LLMEngine.from_kwargs(model=tiny_llama, dtype="float32", kv_cache_memory=16 << 20)
    compiler = engine.structured.compiler
    release, original = threading.Event(), compiler._compile
    compiler._compile = lambda params: release.wait() and original(params)
    engine.add_request("guided", [5, 6, 7], _json_params(0))
    engine.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4,
                                                         ignore_eos=True))
    done = {}
    while "free" not in done:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert "guided" not in done  # still compiling: it never ran, the other one did
    assert engine.structured.num_compiling == 1
    release.set()
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    _assert_valid(done["guided"].outputs[0])
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_failed_compile_fails_only_its_request(tiny_llama):
    engine = LLMEngine.from_kwargs(model=tiny_llama, dtype="float32", kv_cache_memory=16 << 20)

    def broken(params):
        raise RuntimeError("no grammar today")

    engine.structured.compiler._compile = broken
    engine.add_request("bad", [5, 6], _json_params(0, n=2))
    engine.add_request("good", [5, 6], SamplingParams(temperature=0, max_tokens=3,
                                                      ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert "no grammar today" in done["bad"].error
    assert done["good"].error is None and len(done["good"].outputs[0].token_ids) == 3
    assert engine.kv_manager.pool.num_used_blocks == 0
