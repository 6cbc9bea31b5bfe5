"""Tensor parallelism on CPU, for information only: 2 processes x 1 thread (TP=2, gloo) vs
1 process x 2 threads (TP=1), on the same requests, with 1 process x 1 thread as baseline.

On CPU the two ranks share one memory system and gloo all-reduces go through the kernel, so
TP=2 is not expected to win here; the figure that matters needs GPUs (NCCL over NVLink).
SmolLM2-135M (the default model) has 9 attention heads and 3 KV heads, which 2 ranks cannot
split, so by default this runs a random-weight model of SmolLM2's shape with 8 heads of 64
(4 KV heads) instead; --model takes any model whose heads divide by 2.

    python benchmarks/tensor_parallel.py
    python benchmarks/tensor_parallel.py --num-requests 32 --output-len 64 --dtype float32
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from machine import StealMeter


def smollm2_shaped_model(folder: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from quire.models.loader import load_tokenizer, materialize, resolve_model
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                      rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    load_tokenizer(materialize(resolve_model(None))).save_pretrained(folder)
    return folder


def run(model: str, tp: int, threads: int, args) -> None:
    from quire import LLM, SamplingParams
    from quire.worker.model_builder import parameter_bytes
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm = LLM(model, dtype=args.dtype, tensor_parallel_size=tp, num_threads=threads,
              kv_cache_memory=256 << 20)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        one = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts[:1], one, use_tqdm=False)
        single = (time.perf_counter() - start) / 32
        start = time.perf_counter()
        with StealMeter() as steal:
            outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        weights = parameter_bytes(llm.engine.executor.model)
        print(f"TP={tp} x {threads} thread(s), {str(llm.engine.dtype).removeprefix('torch.')}: "
              f"{args.num_requests} requests in {wall:.1f} s, {generated / wall:.1f} generated "
              f"tok/s, {(generated + args.input_len * len(prompts)) / wall:.1f} total tok/s; "
              f"batch-1 {1000 * single:.0f} ms/token (incl. prefill); rank-0 weights "
              f"{weights / 2**20:.0f} MiB; {steal}", flush=True)
    finally:
        llm.engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: a SmolLM2-shaped random model")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or smollm2_shaped_model(tmp)
        run(model, tp=1, threads=1, args=args)  # the baseline both are measured against
        run(model, tp=1, threads=2, args=args)
        run(model, tp=2, threads=1, args=args)


if __name__ == "__main__":
    main()
