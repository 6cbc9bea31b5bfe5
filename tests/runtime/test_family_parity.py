"""The 2026 dense families (Qwen3, Gemma 2, Gemma 3, Phi-3, OLMo 2, Granite) give transformers'
float32 greedy output token for token, each on a tiny config whose special feature changes the
output (a window smaller than the prompts, soft-caps that clip, multipliers other than 1,
LongRoPE's switch inside the prompts' range): in one engine with 48-token chunked prefill and
a KV budget small enough to preempt, then again with prefix-cache hits."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from quire import LLM, SamplingParams
from quire.worker.kv_cache import bytes_per_block

from runtime_helpers import (
    NEW_FAMILIES,
    hf_greedy,
    hf_model,
    random_prompts,
    save_tiny_model,
    tiny_config,
)

MAX_TOKENS = 24
# what turns each family's feature off: transformers' output must change without it, or the
# tiny config would not test the feature
WITHOUT_FEATURE = {
    "qwen3": None,    # its q/k norms have random weights: checked by loading, not a knob
    "gemma2": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
    "gemma3": {"sliding_window": 4096},
    "phi3": {"sliding_window": None},
    "olmo2": None,
    "granite": {"embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                "attention_multiplier": 0.25, "logits_scaling": 1.0},
}


def _kv_budget(cfg, num_blocks: int) -> int:
    import torch
    return num_blocks * bytes_per_block(cfg.num_hidden_layers, 16, cfg.num_key_value_heads,
                                        cfg.head_dim, torch.float32)


# first-step logprobs agree with transformers' to float32 summation-order noise: a feature
# that moves logits without moving the argmax (Gemma 2's final soft-cap) is still checked
LOGPROB_BOUND = 1e-4


def _greedy(llm, prompts, logprobs=None):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                logprobs=logprobs), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _last_logprobs(model, prompts):
    import torch
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1].log_softmax(-1) for p in prompts]


def _diverging(got, expected, prompts):
    return [f"prompt {i} (len {len(prompts[i])}) at token "
            f"{next(j for j, (a, b) in enumerate(zip(g + [-1], e + [-2])) if a != b)}"
            for i, (g, e) in enumerate(zip(got, expected)) if g != e]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_family_matches_transformers_chunked_preempted_and_cached(family, tmp_path,
                                                                   smollm_tokenizer):
    cfg = tiny_config(family)
    path = save_tiny_model(str(tmp_path / family), cfg, smollm_tokenizer)
    prompts = random_prompts()
    reference = hf_model(path)
    expected = hf_greedy(reference, prompts, MAX_TOKENS)
    first_logprobs = _last_logprobs(reference, prompts)

    need = -(-(max(map(len, prompts)) + MAX_TOKENS) // 16)  # the longest request's blocks
    llm = LLM(path, dtype="float32", max_num_batched_tokens=48, enable_prefix_caching=True,
              kv_cache_memory=_kv_budget(cfg, need + 6))
    outs = _greedy(llm, prompts, logprobs=0)
    assert _diverging([o.token_ids for o in outs], expected, prompts) == []
    for o, ref in zip(outs, first_logprobs):
        token = o.token_ids[0]
        assert abs(o.logprobs[0][token].logprob - ref[token].item()) < LOGPROB_BOUND
    engine = llm.engine
    assert engine.scheduler.num_preemptions["recompute"] > 0, "no preemption happened"
    hits_before = engine.kv_manager.prefix_hits
    got = [o.token_ids for o in _greedy(llm, prompts)]
    assert _diverging(got, expected, prompts) == []
    assert engine.kv_manager.prefix_hits > hits_before, "no prefix-cache hit happened"
    assert engine.kv_manager.pool.num_used_blocks == 0


@pytest.mark.parametrize("family", [f for f in NEW_FAMILIES if WITHOUT_FEATURE[f]])
def test_tiny_configs_exercise_the_family_feature(family, tmp_path, smollm_tokenizer):
    """transformers' next-token logprobs move by far more than the parity bound when the
    feature is turned off (the same weights: the feature is a config knob)."""
    prompts = random_prompts()[-4:]  # the longest: past every window and switch
    outputs = []
    for name, overrides in (("with", {}), ("without", WITHOUT_FEATURE[family])):
        path = save_tiny_model(str(tmp_path / name), tiny_config(family, **overrides),
                               smollm_tokenizer)
        outputs.append(_last_logprobs(hf_model(path), prompts))
    moved = max((a - b).abs().max().item() for a, b in zip(*outputs))
    assert moved > 100 * LOGPROB_BOUND


def test_gemma3_alternates_five_local_layers_to_one_global(tmp_path, smollm_tokenizer):
    from quire.models.gemma import LOCAL_ROPE
    cfg = tiny_config("gemma3")
    path = save_tiny_model(str(tmp_path / "g3"), cfg, smollm_tokenizer)
    model = LLM(path, dtype="float32", kv_cache_memory=1 << 20).engine.executor.model
    windows = [layer.backend.sliding_window for layer in model.layers]
    assert windows == [32] * 5 + [None]
    assert [layer.rope_kind for layer in model.layers] == [LOCAL_ROPE] * 5 + ["global"]
    assert model.ropes["global"].rope_type == "linear" and model.ropes[LOCAL_ROPE].base == 1e4


def test_unknown_architecture_is_refused_naming_it_and_the_supported(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path))
    message = str(e.value)
    assert "FalconForCausalLM" in message and "\n" not in message
    for arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                 "Olmo2ForCausalLM", "GraniteForCausalLM", "Gemma2ForCausalLM"):
        assert arch in message


@pytest.mark.filterwarnings("error:The given NumPy array is not writable")  # (an F32 tensor's view)
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_family_from_a_gguf_written_by_llamacpp_matches_transformers(family, tmp_path,
                                                                     smollm_tokenizer,
                                                                     monkeypatch):
    """llama.cpp's converter writes the tiny model as a float32 GGUF (the same values; Gemma's
    norms as 1 + w): Quire reads it (q/k norms, head_dim from the file's key length, Gemma 3's
    query scale by llama.cpp's rule and its rope scaling from the file, no Q/K permutation)
    and gives the folder's transformers output, both dequantized and `auto`. (Gemma 2's
    converter needs a SentencePiece tokenizer.model, which no tiny model here has.) The
    second form's conversion takes the first's config and tokenizer files: transformers
    parses the file for them once, and then reads the conversion's own parse, so each form's
    conversion parses the file once in all."""
    import gguf as gguf_py

    from quire.models import loader

    from llamacpp_converter import convert
    parsed, parses = [], []
    load_tokenizer = loader.load_tokenizer
    monkeypatch.setattr(loader, "load_tokenizer", lambda source, *a, **k: (
        parsed.append(source.kind), load_tokenizer(source, *a, **k))[1])
    reader_init = gguf_py.GGUFReader.__init__
    monkeypatch.setattr(gguf_py.GGUFReader, "__init__", lambda self, path, *a, **k: (
        parses.append(os.path.basename(path)), reader_init(self, path, *a, **k))[1])
    # every array the loader gives torch is writable (torch warns of a read-only one only once
    # a process, so the warning alone would miss it after another test's)
    writable, from_numpy = [], torch.from_numpy
    monkeypatch.setattr(torch, "from_numpy", lambda a: (
        sys._getframe(1).f_code.co_filename == loader.__file__
        and writable.append(a.flags.writeable), from_numpy(a))[1])
    folder = save_tiny_model(str(tmp_path / family), tiny_config(family), smollm_tokenizer)
    gguf = convert(folder, str(tmp_path / f"{family}.gguf"))
    prompts = random_prompts()
    expected = hf_greedy(hf_model(folder), prompts, MAX_TOKENS)
    for quantization in ("none", "auto"):
        llm = LLM(gguf, dtype="float32", quantization=quantization, kv_cache_memory=8 << 20)
        got = [o.token_ids for o in _greedy(llm, prompts)]
        assert _diverging(got, expected, prompts) == [], quantization
    assert writable and all(writable)
    assert parsed.count("gguf") == 1
    assert parses == [f"{family}.gguf"] * 2, parses
    assert isinstance(gguf_py.GGUFReader, type)  # transformers' reader is gguf's own again


def test_yarn_rope_scaling_matches_transformers(tmp_path, smollm_tokenizer):
    """YaRN (Qwen3's long-context setting) through transformers' own frequency function,
    with its attention factor on cos/sin: greedy parity past its original length."""
    cfg = tiny_config("qwen3", rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0})
    path = save_tiny_model(str(tmp_path / "yarn"), cfg, smollm_tokenizer)
    prompts = random_prompts()
    expected = hf_greedy(hf_model(path), prompts, MAX_TOKENS)
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20)
    assert llm.engine.executor.model.rope.rope_type == "yarn"
    assert llm.engine.executor.model.rope.attention_scaling > 1.0
    assert _diverging([o.token_ids for o in _greedy(llm, prompts)], expected, prompts) == []
