"""Prefix caching: 64 requests sharing a 1,024-token system prompt, each with its own
64-token question. Prints mean TTFT and throughput with caching on and off, in one run.

All requests arrive at once (an offline batch), so TTFT includes queueing: with caching
off every request recomputes the system prompt before its first token.

    python benchmarks/prefix_cache.py
    python benchmarks/prefix_cache.py --num-requests 64 --prefix-len 1024 --question-len 64
    python benchmarks/prefix_cache.py --plot     # and plots/prefix_cache.png
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from machine import StealMeter, machine_caption
from plotting import add_plot_flag, grouped_bars


def run(prompts, max_tokens: int, caching: bool, args) -> dict[str, float]:
    from quire import LLM, SamplingParams
    kw = {"num_threads": args.num_threads} if args.num_threads else {}
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(dtype=args.dtype, enable_prefix_caching=caching, **kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([[7, 8, 9]], params, use_tqdm=False)  # warm-up (not sharing the prefix)
    start = time.perf_counter()
    with StealMeter() as steal:
        outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    e = llm.engine
    print(f"caching {'on ' if caching else 'off'}: mean TTFT {statistics.mean(ttft):.2f} s "
          f"(p50 {statistics.median(ttft):.2f} s), {len(prompts)} requests in {wall:.1f} s, "
          f"{generated / wall:.1f} generated tok/s, {(generated + sum(map(len, prompts))) / wall:.1f}"
          f" total tok/s, prompt tokens computed {e.num_prompt_tokens_computed}, "
          f"prefix hits {e.kv_manager.prefix_hits} of {e.kv_manager.prefix_queries} tokens, {steal}")
    return {"mean TTFT (s)": statistics.mean(ttft), "p50 TTFT (s)": statistics.median(ttft),
            "wall (s)": wall}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload's shape (prefix_cache_bound.py models the same one)."""
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the engine's per-step token budget (default: the engine's)")
    ap.add_argument("--only", choices=["on", "off"], default=None,
                    help="run one side only (no ratio)")
    add_plot_flag(ap, "prefix_cache")
    args = ap.parse_args()
    rng = random.Random(0)
    system = [rng.randrange(3, 49152) for _ in range(args.prefix_len)]
    prompts = [system + [rng.randrange(3, 49152) for _ in range(args.question_len)]
               for _ in range(args.num_requests)]
    on = run(prompts, args.max_tokens, True, args) if args.only != "off" else None
    off = run(prompts, args.max_tokens, False, args) if args.only != "on" else None
    if on and off:
        print(f"mean TTFT is {off['mean TTFT (s)'] / on['mean TTFT (s)']:.1f}x lower with "
              "prefix caching")
    if args.plot:
        sides = {name: r for name, r in (("caching on", on), ("caching off", off)) if r}
        keys = list(next(iter(sides.values())))
        grouped_bars(args.plot, f"{args.num_requests} requests sharing a {args.prefix_len}-token "
                     "prefix", "seconds", keys,
                     {name: [r[k] for k in keys] for name, r in sides.items()},
                     caption=machine_caption(args.num_threads))


if __name__ == "__main__":
    main()
