"""Resident memory of loading a pre-quantized checkpoint (layers/prequantized) against the same
model dense: a random Llama written once as float (bf16 safetensors), as compressed-tensors
W4A16 (int4, groups of 128) and as FP8_DYNAMIC (FP8 per channel), each written by
compressed-tensors itself. Each load runs in a fresh process, which reports its resident set
(VmRSS) after imports, after LLM(...) has loaded, and the peak (VmHWM) while loading; the
table gives the growth over the after-imports figure. The issue's bar: int4's growth after
load under 40% of float32's.

    python benchmarks/quantized_memory.py                  # ~0.9B parameters
    python benchmarks/quantized_memory.py --size small     # a few seconds: checks the script
    python benchmarks/quantized_memory.py --keep DIR       # reuse/keep the written folders

Needs compressed-tensors (the test extra). The KV cache is kept to 16 MiB in every run, so
the figures are the weights (and the engine around them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from machine import describe_machine

SIZES = {  # Llama-shaped; "large" is ~0.9B parameters (~0.5B in its decoder layers)
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=4096),
    "large": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
                  num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
}
RUNS = [("float32, dense", "float", "float32"), ("bfloat16, dense", "float", "bfloat16"),
        ("int4 W4A16 g128, float32", "int4", "float32"),
        ("fp8 per channel, float32", "fp8", "float32"),
        ("int4 W4A16 g128, bfloat16", "int4", "bfloat16")]


def write_checkpoints(root: str, size: str) -> dict[str, str]:
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, LlamaConfig
    paths = {kind: os.path.join(root, f"{size}-{kind}") for kind in ("float", "int4", "fp8")}
    config = LlamaConfig(**SIZES[size], max_position_embeddings=2048)
    for kind, path in paths.items():
        if os.path.exists(os.path.join(path, "config.json")):
            continue
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        if kind != "float":
            preset = "W4A16" if kind == "int4" else "FP8_DYNAMIC"
            qconfig = QuantizationConfig(
                config_groups={"g": preset_name_to_scheme(preset, ["Linear"])},
                ignore=["lm_head"])
            apply_quantization_config(model, qconfig)
            with torch.no_grad():
                for module in model.modules():
                    scheme = getattr(module, "quantization_scheme", None)
                    if scheme is None:
                        continue
                    w = module.weight.float()
                    if scheme.weights.strategy == "group":
                        w = w.reshape(w.shape[0], -1, scheme.weights.group_size)
                    lo, hi = w.amin(-1), w.amax(-1)
                    if scheme.weights.strategy == "channel":
                        lo, hi = lo[:, None], hi[:, None]
                    scale, _ = calculate_qparams(lo, hi, scheme.weights)
                    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            compressor = ModelCompressor.from_pretrained_model(model)
            compressor.compress_model(model)
            model.save_pretrained(path)
            compressor.update_config(path)
        else:
            model.save_pretrained(path)
        del model
    return paths


CHILD = r"""
import json, sys
def status():
    out = {}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) * 1024
    return out
from quire import LLM
import quire.layers.prequantized  # imports done before the baseline
base = status()
llm = LLM(sys.argv[1], dtype=sys.argv[2], tokenizer=sys.argv[3], kv_cache_memory=16 << 20,
          enable_prefix_caching=False)
after = status()
llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
print(json.dumps({"base": base["VmRSS"], "after": after["VmRSS"], "peak": after["VmHWM"]}))
"""


def measure(path: str, dtype: str, tokenizer: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, path, dtype, tokenizer],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"loading {path} ({dtype}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="large")
    parser.add_argument("--keep", help="folder for the written checkpoints (reused)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder (default: the default model's, from Quire's "
                             "GGUF cache)")
    args = parser.parse_args()
    tokenizer = args.tokenizer
    if tokenizer is None:
        from quire.models.loader import materialize, resolve_model
        tokenizer = materialize(resolve_model(None), "auto").path
    root = args.keep or tempfile.mkdtemp(prefix="quire-qmem-")
    paths = write_checkpoints(root, args.size)
    print(describe_machine())
    print(f"model: {args.size} {SIZES[args.size]}; checkpoints in {root}")
    mib = 1 << 20
    results = {}
    print(f"{'load':34} {'growth after load':>18} {'peak growth':>12} {'vs float32':>11}")
    for label, kind, dtype in RUNS:
        r = measure(paths[kind], dtype, tokenizer)
        results[label] = r
        growth, peak = r["after"] - r["base"], r["peak"] - r["base"]
        ref = results["float32, dense"]
        ratio = growth / (ref["after"] - ref["base"])
        print(f"{label:34} {growth / mib:15.1f} MiB {peak / mib:9.1f} MiB {ratio:10.1%}")
    int4 = results["int4 W4A16 g128, float32"]
    f32 = results["float32, dense"]
    ratio = (int4["after"] - int4["base"]) / (f32["after"] - f32["base"])
    print(f"int4 growth after load: {ratio:.1%} of float32's "
          f"({'under' if ratio < 0.4 else 'NOT under'} the 40% bar)")


if __name__ == "__main__":
    main()
