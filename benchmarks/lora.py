"""Multi-LoRA throughput: 1, 4 and 16 distinct adapters in the batch vs the base model only.

Random rank-16 adapters on all seven targets (q/k/v/o/gate/up/down) of the default model
(SmolLM2-135M-Instruct), written in PEFT's format into a temporary folder. The same N requests
(random-token prompts, greedy, ignore_eos) run: on an engine without LoRA; on the LoRA engine
for the base model only; and on it with the requests spread round-robin over k adapters. The
LoRA engine has max_loras = the largest k, so every adapter holds a slot (loaded in a warm-up).
Prefix caching is off, so no run reuses another's prompts. On a shared machine, compare only
figures taken back to back with little steal and load (the output says the steal).

    python benchmarks/lora.py --num-requests 64 --input-len 128 --output-len 64
    python benchmarks/lora.py --num-requests 8 --output-len 8 --adapters 1,4   # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from machine import StealMeter

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapter(path: str, cfg, rank: int, seed: int) -> str:
    """A PEFT LoRA folder by hand: adapter_config.json + adapter_model.safetensors."""
    import torch
    from safetensors.torch import save_file
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    sizes = {"q_proj": (h, cfg.num_heads * d), "k_proj": (h, cfg.num_kv_heads * d),
             "v_proj": (h, cfg.num_kv_heads * d), "o_proj": (cfg.num_heads * d, h),
             "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, block in TARGETS.items():
            fan_in, fan_out = sizes[module]
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(TARGETS), "bias": "none"}, f)
    return path


def run(llm, prompts, params, loras, label: str) -> float:
    from quire import SamplingParams
    warm = list(dict.fromkeys(loras)) if loras else [None]  # reads each adapter into a slot
    llm.generate([prompts[0]] * len(warm), SamplingParams(max_tokens=2), use_tqdm=False,
                 lora_request=warm)
    start, cpu_start = time.perf_counter(), time.process_time()
    with StealMeter() as steal:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start  # less swayed than wall time by other processes
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{label:<24} {len(prompts)} requests in {wall:6.1f} s: {generated / wall:7.1f} "
          f"generated tok/s, {(generated + sum(map(len, prompts))) / wall:7.1f} total tok/s; "
          f"{cpu:6.1f} CPU s, {generated / cpu:6.1f} generated tok per CPU s ({steal})",
          flush=True)
    return generated / cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--adapters", default="1,4,16", help="distinct adapters per run")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    counts = [int(k) for k in args.adapters.split(",")]

    from quire import LLM, LoRARequest, SamplingParams
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 49152) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
              ] * args.num_requests
    # no prefix caching: a later run would find an earlier one's prompts (same adapter) cached
    common = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    if args.num_threads:
        common["num_threads"] = args.num_threads

    base = LLM(**common)
    print(f"model {base.engine.model_name}, {str(base.engine.dtype).removeprefix('torch.')}, "
          f"attention {base.engine.attention_backend}; rank-{args.rank} adapters on "
          f"{len(TARGETS)} targets")
    results = {"base, LoRA off": run(base, prompts, params, None, "base model, LoRA off")}
    cfg = base.engine.model_config
    del base

    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_random_adapter(os.path.join(tmp, f"a{i}"), cfg, args.rank, seed=i)
                 for i in range(max(counts))]
        llm = LLM(enable_lora=True, max_loras=max(counts), max_lora_rank=args.rank, **common)
        results["base, LoRA on"] = run(llm, prompts, params, None, "base model, LoRA on")
        for k in counts:
            loras = [LoRARequest(f"a{i % k}", i % k + 1, paths[i % k])
                     for i in range(args.num_requests)]
            results[f"{k} adapters"] = run(llm, prompts, params, loras,
                                           f"{k} distinct adapter{'s' * (k > 1)}")
    ref = results["base, LoRA off"]
    print("generated tokens per CPU second relative to the base model, LoRA off: " + ", ".join(
        f"{name} {tps / ref:.2f}x" for name, tps in results.items()))


if __name__ == "__main__":
    main()
