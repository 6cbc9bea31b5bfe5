"""The LoRA flags of `quire serve`: --lora-modules in vLLM's two spellings, errors that name
the flag, and --allow-runtime-lora (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) needing
--enable-lora."""

from __future__ import annotations

import json

import pytest

from quire.entrypoints.cli import build_parser, main
from quire.entrypoints.engine_args import engine_args_from
from quire.entrypoints.serve import lora_parents, runtime_lora_allowed, served_names


def parse(*flags):
    return build_parser().parse_args(["serve", "some-model", *flags])


def test_lora_modules_both_forms():
    ns = parse("--enable-lora", "--max-loras", "2", "--max-lora-rank", "64",
               "--max-cpu-loras", "3", "--lora-modules", "sql=/adapters/sql",
               json.dumps({"name": "chat", "path": "/adapters/chat",
                           "base_model_name": "llama"}), "x=a=b")
    args = engine_args_from(ns, "some-model")
    assert args.lora_modules == {"sql": "/adapters/sql", "chat": "/adapters/chat", "x": "a=b"}
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == \
        (True, 2, 64, 3)
    assert lora_parents(ns) == {"chat": "llama"}
    assert engine_args_from(parse(), "m").lora_modules is None


@pytest.mark.parametrize("value, words", [
    ("no-equals-sign", "expected name=path"),
    ("=path", "expected name=path"),
    ("name=", "expected name=path"),
    ('{"name": "x"', "not valid JSON"),
    ('{"name": "x"}', "'path' must be a non-empty string"),
    ('{"name": "x", "path": "p", "rank": 8}', "unknown key 'rank'"),
    ('{"name": "x", "path": "p", "base_model_name": 3}', "'base_model_name'"),
])
def test_bad_lora_modules_name_the_flag(capsys, value, words):
    with pytest.raises(SystemExit) as e:
        parse("--enable-lora", "--lora-modules", value)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --lora-modules" in err and words in err, err


@pytest.mark.parametrize("flags, words", [
    (["--enable-lora", "--max-loras", "0"], "--max-loras: max_loras must be"),
    (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank: max_lora_rank must be"),
    (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"],
     "--max-cpu-loras: max_cpu_loras must be >= max_loras"),
    (["--lora-modules", "a=/x"], "--lora-modules: lora_modules needs enable_lora"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "--lora-modules: the adapter name 'a' is given twice"),
])
def test_bad_values_name_the_flag(flags, words):
    with pytest.raises(ValueError, match="^" + words.replace("(", r"\(")):
        engine_args_from(parse(*flags), "m")


def test_bad_flag_value_exits_2_with_the_flag(capsys):
    assert main(["serve", "m", "--enable-lora", "--max-loras", "0"]) == 2
    assert "--max-loras" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "m", "--max-loras", "two"])
    assert "argument --max-loras: invalid int value: 'two'" in capsys.readouterr().err


def test_allow_runtime_lora_flag_or_vllm_environment():
    on = parse("--enable-lora")
    assert runtime_lora_allowed(on, {}) is False
    assert runtime_lora_allowed(parse("--enable-lora", "--allow-runtime-lora"), {}) is True
    for value in ("true", "True", "1", " TRUE "):
        assert runtime_lora_allowed(on, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}) is True
    for value in ("false", "0", ""):
        assert runtime_lora_allowed(on, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}) is False
    with pytest.raises(ValueError, match="--allow-runtime-lora needs --enable-lora"):
        runtime_lora_allowed(parse("--allow-runtime-lora"), {})
    with pytest.raises(ValueError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=true needs "
                                         "--enable-lora"):
        runtime_lora_allowed(parse(), {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})


def test_served_model_names_and_their_trap():
    assert served_names(parse("--served-model-name", "a", "b")) == ["a", "b"]
    assert served_names(parse()) == []
    ns = build_parser().parse_args(["serve", "--served-model-name", "a", "/models/x"])
    with pytest.raises(ValueError, match="put MODEL first"):
        served_names(ns)
