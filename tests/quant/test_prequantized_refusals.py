"""Pre-quantized schemes Quire does not run are refused at load, each with one line that
names the scheme and what is supported; an explicit --quantization that contradicts the
checkpoint is refused too. Nothing falls back to float. (Config-level: a config.json with
the quantization_config and no weights is enough, the refusal comes before any tensor.)"""

from __future__ import annotations

import json

import pytest

from quire.models.loader import ModelSource, quant_config

INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
        "symmetric": True, "dynamic": False}


def _ct(weights=None, acts=None, fmt="pack-quantized", **extra):
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights or INT4,
                                          "input_activations": acts, "format": fmt}},
            **extra}


REFUSALS = {
    "ct-W4A4": (_ct(acts={"num_bits": 4, "type": "int", "strategy": "token",
                          "dynamic": True, "symmetric": True}, fmt="int-quantized"),
                "auto", r"scheme W4A4 \(activations quantized to int4\)"),
    "ct-W8A8-int": (_ct(weights={**INT4, "num_bits": 8, "strategy": "channel"},
                        acts={"num_bits": 8, "type": "int", "strategy": "token",
                              "dynamic": True}, fmt="int-quantized"),
                    "auto", r"scheme W8A8"),
    "ct-2of4-sparsity": (_ct(sparsity_config={"format": "sparse-24-bitmask",
                                              "sparsity_structure": "2:4"}),
                         "auto", r"sparsity \(sparse-24-bitmask"),
    "ct-group-16": (_ct(weights={**INT4, "group_size": 16}), "auto", r"group size 16"),
    "ct-3-bit": (_ct(weights={**INT4, "num_bits": 3}), "auto", r"3-bit weights"),
    "ct-int8-asym": (_ct(weights={**INT4, "num_bits": 8, "symmetric": False}), "auto",
                     r"asymmetric 8-bit weights"),
    "ct-nvfp4": (_ct(weights={**INT4, "type": "float", "group_size": 16},
                     fmt="nvfp4-pack-quantized"), "auto", r"scheme WFP4A16"),
    "ct-kv-cache-scheme": (_ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "auto",
                           r"kv_cache_scheme"),
    "ct-transform": (_ct(transform_config={"config_groups": {"u": {}}}), "auto",
                     r"transform_config"),
    "gptq-3-bit": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "auto",
                   r"gptq: 3-bit weights are not supported; supported: bits 4 or 8"),
    "gptq-group-16": ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "auto",
                      r"gptq: group_size 16"),
    "gptq-lm-head": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True},
                     "auto", r"quantized lm_head"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
                 "auto", r"awq: version 'gemv'"),
    "fp8-static-activations": ({"quant_method": "fp8", "weight_block_size": [128, 128],
                                "activation_scheme": "static"}, "auto",
                               r"activation_scheme 'static'"),
    "unknown-method": ({"quant_method": "bitsandbytes"}, "auto",
                       r"quant_method 'bitsandbytes' is not supported; supported: "
                       r"compressed-tensors, gptq, awq, fp8"),
    "explicit-int4-on-gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "int4",
                              r"--quantization int4 contradicts the checkpoint, which is "
                              r"quantized with gptq"),
    "explicit-none-on-awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, "none",
                             r"--quantization none contradicts"),
    "explicit-gptq-on-awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, "gptq",
                             r"--quantization gptq contradicts"),
    "explicit-gptq-on-float": (None, "gptq", r"--quantization gptq needs a checkpoint "
                                             r"quantized with it"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_scheme_is_refused_in_one_line(case, tmp_path):
    qcfg, quantization, message = REFUSALS[case]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if qcfg is not None:
        config["quantization_config"] = qcfg
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as e:
        quant_config(ModelSource("hf", str(tmp_path), "m"), quantization, 32)
    assert "\n" not in str(e.value) and "supported" in str(e.value)
