"""Offline throughput: Quire vs transformers' generate on the same requests.

N requests (seeded) with random-token prompts of 32-512 tokens and outputs of 32-256 tokens
(ignore_eos), greedy, on the default model (SmolLM2-135M-Instruct). transformers runs at each
batch size and dtype asked for, left-padded, requests sorted by length so that padding wastes
as little as possible (its best case); only the tokens each request asked for count.

    python benchmarks/throughput.py --num-requests 128
    python benchmarks/throughput.py --num-requests 128 --skip-hf      # Quire only
"""

from __future__ import annotations

import argparse
import random
import resource
import time

from machine import StealMeter


def make_requests(n: int, seed: int, vocab: int = 49152):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))]
        reqs.append((prompt, rng.randint(32, 256)))
    return reqs


def run_quire(reqs, args) -> float:
    from quire import LLM, SamplingParams
    kw = {k: v for k, v in (("dtype", args.dtype), ("max_num_seqs", args.max_num_seqs),
                            ("max_num_batched_tokens", args.max_num_batched_tokens),
                            ("num_threads", args.num_threads)) if v is not None}
    llm = LLM(**kw)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.generate([p for p, _ in reqs[:4]], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    with StealMeter() as steal:
        outs = llm.generate([p for p, _ in reqs], params, use_tqdm=not args.quiet)
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == sum(m for _, m in reqs)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    e = llm.engine
    print(f"quire ({str(e.dtype).removeprefix('torch.')}, attention {e.attention_backend}, "
          f"max_num_seqs {e.args.max_num_seqs}, max_num_batched_tokens "
          f"{e.args.max_num_batched_tokens}): {len(reqs)} requests in {wall:.1f} s, "
          f"{generated / wall:.1f} generated tok/s, {(generated + prompt_tokens) / wall:.1f} "
          f"total tok/s, TTFT p50 {ttft[len(ttft) // 2]:.2f} s, preemptions "
          f"{sum(e.scheduler.num_preemptions.values())}, {steal}")
    return generated / wall


def run_hf(reqs, batch_size: int, dtype: str, limit: int | None) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from quire.models.loader import materialize, resolve_model
    # Dense weights, from the Hugging Face folder Quire converts the GGUF file into: loaded
    # with gguf_file=, transformers 5 keeps the tensors quantized and dequantizes them in
    # every matmul, which would make it several times slower than it needs to be.
    folder = materialize(resolve_model(None)).path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    order = sorted(reqs, key=lambda r: len(r[0]) + r[1])
    if limit and limit < len(order):  # an evenly spaced subset: representative lengths
        order = [order[i * len(order) // limit] for i in range(limit)]
    generated, start = 0, time.perf_counter()
    steal = StealMeter().__enter__()
    with torch.inference_mode():
        for i in range(0, len(order), batch_size):
            batch = order[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            new = max(m for _, m in batch)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=0)
            generated += sum(m for _, m in batch)
    wall = time.perf_counter() - start
    steal.__exit__()
    print(f"transformers ({dtype}, batch {batch_size}): {len(order)} requests in {wall:.1f} s, "
          f"{generated / wall:.1f} generated tok/s, {steal}")
    return generated / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default=None, help="Quire's dtype (default: auto)")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--hf-batch-sizes", default="8,16,32")
    ap.add_argument("--hf-dtypes", default="float32,bfloat16")
    ap.add_argument("--hf-limit", type=int, default=None,
                    help="time transformers on an evenly spaced subset of this many requests "
                         "(its tok/s still compares; the full set takes hours)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    reqs = make_requests(args.num_requests, args.seed)
    print(f"{len(reqs)} requests: prompts {sum(len(p) for p, _ in reqs)} tokens, outputs "
          f"{sum(m for _, m in reqs)} tokens")
    quire = run_quire(reqs, args)
    print(f"peak RSS after Quire: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if args.skip_hf:
        return
    best = max((run_hf(reqs, b, d, args.hf_limit), f"{d}, batch {b}")
               for d in args.hf_dtypes.split(",") for b in map(int, args.hf_batch_sizes.split(",")))
    print(f"best transformers: {best[0]:.1f} tok/s ({best[1]}); Quire / best = "
          f"{quire / best[0]:.2f}x")


if __name__ == "__main__":
    main()
