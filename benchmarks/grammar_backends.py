"""Which grammar library sits behind quire/structured: mask time per token, compile time and
JSON-schema coverage of llguidance, xgrammar and outlines-core, on SmolLM2's tokenizer
(49,152 tokens).

    python benchmarks/grammar_backends.py

Each library walks the same schema-valid JSON document token by token, computing the full
vocabulary mask before every token (what the engine does each decode step). Libraries that are
not installed are skipped.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))

from runtime_helpers import smollm2_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False,
        },
        "status": {"enum": ["active", "inactive"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "status", "score"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
    "status": "active", "score": 99.5}, separators=(",", ":"))

# one keyword each; a library "covers" it when it compiles the schema without error
COVERAGE = {
    "$ref/$defs": {"$defs": {"p": {"type": "integer"}}, "type": "object",
                   "properties": {"a": {"$ref": "#/$defs/p"}}},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"required": ["a"]}]},
    "enum/const": {"type": "object", "properties": {"a": {"enum": [1, "x"]}, "b": {"const": 3}}},
    "pattern": {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"},
    "format: date-time": {"type": "string", "format": "date-time"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minimum/maximum": {"type": "integer", "minimum": -5, "maximum": 500},
    "exclusiveMinimum (number)": {"type": "number", "exclusiveMinimum": 0.5},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                          "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "additionalProperties schema": {"type": "object",
                                    "additionalProperties": {"type": "integer"}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    "type list": {"type": ["string", "null"]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
}


def bench_llguidance(tok, ids):
    import llguidance
    import llguidance.hf
    import llguidance.torch
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    tok_s = time.perf_counter() - t0

    def compile_(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        m = llguidance.LLMatcher(lltok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    t0 = time.perf_counter()
    m = compile_(SCHEMA)
    compile_s = time.perf_counter() - t0
    mask = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        s = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(m, mask)
        times.append(time.perf_counter() - s)
        assert m.consume_token(t), (t, m.get_error())
    return tok_s, compile_s, times, compile_


def bench_xgrammar(tok, ids):
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=tok.vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    tok_s = time.perf_counter() - t0

    def compile_(schema):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                             separators=(",", ":"))

    t0 = time.perf_counter()
    compiled = compile_(SCHEMA)
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        s = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        assert m.accept_token(t), t
    return tok_s, compile_s, times, compile_


def bench_outlines_core(tok, ids):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    vocab = Vocabulary.from_pretrained  # needs a hub download: build it from the tokenizer
    eos = tok.eos_token_id
    tokens = {}
    for t, i in tok.get_vocab().items():
        if i == eos:
            continue
        tokens.setdefault(tok.convert_tokens_to_string([t]), []).append(i)
    vocab = Vocabulary(eos, tokens)
    tok_s = time.perf_counter() - t0

    def compile_(schema):
        return Index(build_regex_from_schema(json.dumps(schema)), vocab)

    t0 = time.perf_counter()
    index = compile_(SCHEMA)
    compile_s = time.perf_counter() - t0
    guide = Guide(index)
    times = []
    for t in ids:
        s = time.perf_counter()
        allowed = guide.get_tokens()  # a list of ids; a bitmask still has to be built from it
        times.append(time.perf_counter() - s)
        assert t in allowed, t
        guide.advance(t)
    return tok_s, compile_s, times, compile_


def main() -> None:
    tok = smollm2_tokenizer()
    ids = tok(DOCUMENT).input_ids
    print(f"vocab {tok.vocab_size}, document of {len(ids)} tokens")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                        ("outlines-core", bench_outlines_core)):
        try:
            tok_s, compile_s, times, compile_ = bench(tok, ids)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        except Exception as e:  # a library that can't walk the document is a finding too
            print(f"{name}: failed: {type(e).__name__}: {e}")
            continue
        covered = []
        for kw, schema in COVERAGE.items():
            try:
                compile_(schema)
                covered.append(kw)
            except Exception:
                pass
        us = [t * 1e6 for t in times]
        print(f"{name:14s} tokenizer {tok_s * 1e3:7.0f} ms  compile {compile_s * 1e3:7.1f} ms  "
              f"mask/token mean {statistics.mean(us):7.1f} us  p50 {statistics.median(us):7.1f}"
              f"  max {max(us):8.1f} us  coverage {len(covered)}/{len(COVERAGE)}")
        missing = [k for k in COVERAGE if k not in covered]
        if missing:
            print(f"{'':14s} not covered: {', '.join(missing)}")


if __name__ == "__main__":
    main()
