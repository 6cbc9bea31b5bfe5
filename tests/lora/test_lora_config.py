"""Bad LoRA settings and bad adapters are rejected with errors that name what is wrong, and
leave nothing half-registered."""

from __future__ import annotations

import shutil

import pytest

from quire import LLM, EngineArgs, LoRARequest, SamplingParams

from lora_helpers import (
    edit_adapter_config,
    save_random_adapter,
    save_tiny_model,
    smollm2_tokenizer,
    tiny_config,
)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
               kv_cache_memory=4 << 20)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_loras=0), "max_loras must be an integer >= 1"),
    (dict(max_lora_rank=0), "max_lora_rank must be an integer >= 1"),
    (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras must be >= max_loras \(4\)"),
    (dict(enable_lora="yes"), "enable_lora must be a boolean"),
    (dict(lora_modules={"a": "/x"}), "lora_modules needs enable_lora=True"),
    (dict(enable_lora=True, lora_modules=["a=/x"]), "lora_modules must map adapter names"),
])
def test_bad_engine_args(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


@pytest.mark.parametrize("args,message", [
    (("", 1, "/p"), "lora_request.name"), (("a", 0, "/p"), "lora_request.id"),
    (("a", True, "/p"), "lora_request.id"), (("a", 1, ""), "lora_request.path"),
])
def test_bad_lora_request(args, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)


def test_lora_request_needs_enable_lora(tiny_llama, adapters):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([[5, 6]], lora_request=LoRARequest("a", 1, adapters["a"]), use_tqdm=False)
    assert llm.engine.kv_manager.pool.num_used_blocks == 0 and llm.engine.list_loras() == []


def test_rank_above_max_lora_rank(llm, adapters):
    with pytest.raises(ValueError, match=r"'r' is 16, more than max_lora_rank \(8\)"):
        llm.engine.add_lora(LoRARequest("a", 1, adapters["a"]))
    assert llm.engine.list_loras() == []


def test_rank_pattern_above_max_lora_rank(tiny_llama, adapters):
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=4,
              kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match=r"rank_pattern.*down_proj.*rank 8, more than "
                                         r"max_lora_rank \(4\)"):
        llm.engine.add_lora(LoRARequest("b", 1, adapters["b"]))


@pytest.mark.parametrize("change,message", [
    (dict(use_dora=True), "'use_dora' is set"),
    (dict(bias="all"), "'bias' is 'all'"),
    (dict(modules_to_save=["lm_head"]), "'modules_to_save'"),
    (dict(peft_type="IA3"), "'peft_type' is 'IA3'"),
    (dict(target_modules=["q_proj", "embed_tokens"]), r"'target_modules' has \['embed_tokens'\]"),
    (dict(r=0), "'r' must be a positive integer"),
])
def test_unservable_adapter_configs(llm, adapters, tmp_path, change, message):
    path = shutil.copytree(adapters["b"], tmp_path / "bad")
    edit_adapter_config(str(path), **change)
    with pytest.raises(ValueError, match=message):
        llm.engine.add_lora(LoRARequest("bad", 5, str(path)))
    assert llm.engine.list_loras() == []


def test_missing_folder_and_missing_weights(llm, adapters, tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.engine.add_lora(LoRARequest("x", 5, str(tmp_path / "nowhere")))
    path = shutil.copytree(adapters["b"], tmp_path / "noweights")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        llm.engine.add_lora(LoRARequest("x", 5, str(path)))


def test_adapter_on_other_modules_or_another_model(llm, tiny_llama, tmp_path):
    head = save_random_adapter(tiny_llama, str(tmp_path / "head"), r=4,
                               targets=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="lm_head"):
        llm.engine.add_lora(LoRARequest("head", 5, head))
    other = save_tiny_model(str(tmp_path / "other"), tiny_config("llama", hidden_size=32),
                            smollm2_tokenizer())
    wrong = save_random_adapter(other, str(tmp_path / "wrong"), r=4)
    with pytest.raises(ValueError, match="lora_A has input size 32, the model's is 64"):
        llm.engine.add_lora(LoRARequest("wrong", 6, wrong))
    assert llm.engine.list_loras() == []


def test_names_and_ids_are_unique(llm, adapters, tmp_path):
    b = LoRARequest("b", 1, adapters["b"])
    assert llm.engine.add_lora(b)
    try:
        with pytest.raises(ValueError, match="named 'b' is already loaded"):
            llm.engine.add_lora(LoRARequest("b", 2, adapters["b"]))
        with pytest.raises(ValueError, match="id 1 is already used by adapter 'b'"):
            llm.engine.add_lora(LoRARequest("b2", 1, adapters["b"]))
        with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
            LLM.generate(llm, [[5], [6]], SamplingParams(max_tokens=1), use_tqdm=False,
                         lora_request=[b])
    finally:
        llm.engine.remove_lora("b")
