"""Loading: GGUF and Hugging Face folders agree; broken or unsupported models say so clearly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from quire import LLM, SamplingParams
from quire.models.loader import unpermute_qk

from runtime_helpers import assert_no_blocks_in_use


def _logprobs(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=20),
                        use_tqdm=False)
    return [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
            for o in outs]


def test_gguf_and_hf_folder_give_the_same_logits(tmp_path, hf_smollm, smollm_tokenizer, smollm):
    from safetensors.torch import save_file
    folder = tmp_path / "smollm2-hf"
    folder.mkdir()
    # transformers' own dequantization and un-permutation (it refuses save_pretrained on a
    # GGUF-loaded model, so the state dict is written directly; lm_head is tied)
    state = {k: v.contiguous() for k, v in hf_smollm.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(folder / "model.safetensors"))
    config = hf_smollm.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    smollm_tokenizer.save_pretrained(folder)
    from_folder = LLM(str(folder), dtype="float32", kv_cache_memory=64 << 20)
    prompts = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]
    a, b = _logprobs(smollm, prompts), _logprobs(from_folder, prompts)
    for steps_a, steps_b in zip(a, b):
        for la, lb in zip(steps_a, steps_b):
            assert la.keys() == lb.keys()  # the same top-20 tokens at every step
            for t in la:
                assert la[t] == pytest.approx(lb[t], abs=1e-4)
    assert_no_blocks_in_use(from_folder)


def test_gguf_q_k_permutation_is_undone():
    """llama.cpp's converter: reshape(n_head, 2, d/2, ...) then swap axes 1 and 2."""
    n_head, head_dim, hidden = 3, 8, 5
    w = np.arange(n_head * head_dim * hidden, dtype=np.float32).reshape(n_head * head_dim, hidden)
    permuted = w.reshape(n_head, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_qk(permuted, n_head), w)


def test_transformers_reads_the_loads_own_gguf_parse_and_then_gguf_has_its_reader_back(
        tmp_path):
    """loader._parsed_once: inside it gguf.GGUFReader hands the given parse out for that file
    only (another file still gets a reader of its own, here gguf's error on a file that is no
    GGUF), a second block nests inside the first, and the class is back however a block
    ends."""
    import gguf

    from quire.models import loader
    own = gguf.GGUFReader
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(b"not read")
    second.write_bytes(b"not a GGUF either")

    class Parsed:
        def __init__(self, path):
            self.source_path = str(path)
    a, b = Parsed(first), Parsed(second)
    with pytest.raises(RuntimeError, match="inside"):
        with loader._parsed_once(a):
            assert gguf.GGUFReader(str(first)) is a
            assert gguf.GGUFReader(str(tmp_path / "." / "a.gguf")) is a  # the same file
            with pytest.raises(Exception) as other:
                gguf.GGUFReader(str(second))
            assert other.type is not RuntimeError
            with loader._parsed_once(b):
                assert gguf.GGUFReader(str(second)) is b and gguf.GGUFReader(str(first)) is a
            raise RuntimeError("inside")
    assert gguf.GGUFReader is own


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_broken_gguf_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="broken.gguf.*not a readable GGUF"):
        LLM(str(bad))
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # no half-written conversion


def test_missing_weights_are_named(tmp_path, tiny_models):
    import shutil

    from safetensors.torch import load_file, save_file
    folder = tmp_path / "partial"
    shutil.copytree(tiny_models["llama"], folder)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 weights.*layers.1.down_proj"):
        LLM(str(folder), dtype="float32", kv_cache_memory=1 << 20)


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(ValueError, match="no-such-model.*does not exist"):
        LLM(str(tmp_path / "no-such-model"), kv_cache_memory=1 << 20)


def test_dtype_auto_picks_bfloat16_where_the_cpu_multiplies_it_natively(tiny_models):
    from quire.platform import cpu_has_native_bf16
    llm = LLM(tiny_models["llama"], kv_cache_memory=1 << 20)
    assert llm.engine.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
