"""Pipeline parallelism on CPU, for information: two stages (2 processes x 1 thread, gloo)
beside one process x 2 threads, on the same requests, in one run; and the micro-batch overlap
per step: the same pipeline with one micro-batch per step (the stages take turns) and with
two (stage 0 computes the second while stage 1 computes the first).

On one CPU the stages share the cores and memory, so PP=2 is not expected to beat one process
here: the point is correctness (tests/distributed/test_pp_parity.py) and that the overlap
works. The default model is SmolLM2-135M (30 layers: 15 per stage).

    python benchmarks/pipeline_parallel.py
    python benchmarks/pipeline_parallel.py --num-requests 32 --input-len 256 --plot
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars


def _timed_steps(engine) -> list[tuple[int, float]]:
    """(tokens, seconds) of every executor step from now on."""
    steps: list[tuple[int, float]] = []
    execute = engine.executor.execute

    def timed(out):
        start = time.perf_counter()
        try:
            return execute(out)
        finally:
            if not out.empty:
                tokens = sum(len(c.token_ids) for c in out.batch.chunks)
                steps.append((tokens, time.perf_counter() - start))
    engine.executor.execute = timed
    return steps


def run(label: str, args, pp: int, threads: int, micro_batches: int | None = None) -> dict:
    from quire import LLM, SamplingParams
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    llm = LLM(args.model, dtype=args.dtype, pipeline_parallel_size=pp, num_threads=threads,
              kv_cache_memory=512 << 20, enable_prefix_caching=False)
    try:
        if micro_batches is not None:
            llm.engine.executor.runner.micro_batches = micro_batches
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        first = SamplingParams(temperature=0, max_tokens=1)
        ttfts = []
        for p in prompts[:3]:
            start = time.perf_counter()
            llm.generate([p[::-1]], first, use_tqdm=False)  # reversed: not a prefix hit
            ttfts.append(time.perf_counter() - start)
        steps = _timed_steps(llm.engine)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        start = time.perf_counter()
        with StealMeter() as steal:
            outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        llm.engine.shutdown()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    prefill = [t for n, t in steps if n > args.num_requests]
    decode = [t for n, t in steps if n <= args.num_requests]
    row = {"label": label, "ttft": statistics.median(ttfts), "gen": generated / wall,
           "total": (generated + args.input_len * len(prompts)) / wall,
           "prefill_step": statistics.median(prefill) if prefill else float("nan"),
           "decode_step": statistics.median(decode) if decode else float("nan")}
    print(f"{label:<34} TTFT {row['ttft'] * 1000:7.0f} ms | {row['gen']:7.1f} generated tok/s,"
          f" {row['total']:7.1f} total tok/s | median step: prefill {row['prefill_step'] * 1000:6.0f}"
          f" ms ({len(prefill)}), decode {row['decode_step'] * 1000:5.1f} ms ({len(decode)}) "
          f"| {steal}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    add_plot_flag(p, "pipeline_parallel")
    args = p.parse_args()
    print(describe_machine(2))
    print(f"{args.num_requests} requests x {args.input_len} prompt tokens -> {args.output_len} "
          f"generated, {args.dtype}; TTFT: one {args.input_len}-token prompt alone")
    rows = [run("one process x 2 threads", args, pp=1, threads=2),
            run("PP=2 x 1 thread, 1 micro-batch", args, pp=2, threads=1, micro_batches=1),
            run("PP=2 x 1 thread, 2 micro-batches", args, pp=2, threads=1)]
    _, serial, overlapped = rows
    for kind in ("prefill_step", "decode_step"):
        saved = 1 - overlapped[kind] / serial[kind]
        print(f"micro-batch overlap, {kind.replace('_', ' ')}s: {serial[kind] * 1000:.1f} ms "
              f"-> {overlapped[kind] * 1000:.1f} ms ({saved:+.0%} of the step; two stages "
              f"with two micro-batches can save at most 25%)")
    if args.plot:
        grouped_bars(args.plot, "Pipeline parallelism on CPU (information)", "ms / tok/s",
                     ["TTFT (ms)", "prefill step (ms)", "generated tok/s"],
                     {r["label"]: [r["ttft"] * 1000, r["prefill_step"] * 1000, r["gen"]]
                      for r in rows}, caption=machine_caption(2))


if __name__ == "__main__":
    main()
