"""Where a decode step's time goes: single stream (128-token prompt, 256 tokens out, greedy)
in bfloat16 and float32, and 32 sequences decoding side by side, on the default model.
`--temperature T` samples instead (`--top-p P`; `--seeded`: each request with a seed of its
own).

For each case it prints the decode speed (steps timed after the prefill), then a
torch.profiler table of the top ops over a stretch of decode steps: each op's share of the
profiled step's wall time and its milliseconds per step; what no torch op accounts for (Python,
the native kernels called through ctypes, scheduling, sampling) is the last row. Where decode
steps run in the native decode stack (a quantized model: quire/native/decode_stack.py), a
second table splits the stack's time by phase (its own timers, summed over the layers).

    python benchmarks/decode_profile.py
    python benchmarks/decode_profile.py --cases bf16-1 --steps 64 --top 12

With `--baseline REV` it measures the engine-step cost of this checkout beside an older
commit's engine (a `git archive` snapshot of its runtime/), in alternating rounds in fresh
processes, and prints each case's median ms per decode step for both and their ratio, for the
whole step and for the part outside the model's forward (ModelRunner.run): the engine's own
overhead, which the native kernels' run-to-run noise does not blur:

    python benchmarks/decode_profile.py --baseline e189fa3 --rounds 5 --cases bf16-1,bf16-32
    python benchmarks/decode_profile.py --baseline HEAD --cases fp32-32 --temperature 0.8
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import time

from machine import StealMeter
from processes import runtime_snapshot

CASES = {"bf16-1": ("bfloat16", 1), "fp32-1": ("float32", 1), "bf16-32": ("bfloat16", 32),
         "fp32-32": ("float32", 32)}


def _start(llm, batch: int, prompt_len: int, max_tokens: int, seed: int, args) -> None:
    """Queue `batch` requests and run steps until all have their first token (prefill)."""
    from quire import SamplingParams
    rng = random.Random(seed)
    for i in range(batch):
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                max_tokens=max_tokens, ignore_eos=True,
                                seed=i if args.seeded else None)
        llm.engine.add_request(None, [rng.randrange(3, 49152) for _ in range(prompt_len)], params)
    while llm.engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.scheduler.running):
        llm.engine.step()


def _finish(llm) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def decode_speed(llm, batch: int, args) -> tuple[float, float, int]:
    """Seconds per decode step, and the part of it spent outside the model's forward (the
    engine's own overhead: scheduling, features, batch building, sampling, detokenizing)."""
    from quire.worker.model_runner import ModelRunner  # the same class in older commits
    forward = ModelRunner.run
    in_forward = [0.0]

    def timed_run(self, inputs):
        t = time.perf_counter()
        try:
            return forward(self, inputs)
        finally:
            in_forward[0] += time.perf_counter() - t

    _start(llm, batch, args.prompt_len, args.max_tokens, 1, args)
    ModelRunner.run = timed_run
    try:
        steps, start = 0, time.perf_counter()
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            steps += 1
        wall = time.perf_counter() - start
    finally:
        ModelRunner.run = forward
    steps = max(steps, 1)
    return wall / steps, (wall - in_forward[0]) / steps, steps


def profile(llm, batch: int, args) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    _start(llm, batch, args.prompt_len, args.steps + 2, 2, args)
    stack = getattr(llm.engine.executor.runner, "decode_stack", None)
    if stack is not None:
        stack.profile()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            llm.engine.step()
        wall = time.perf_counter() - start
    _finish(llm)
    step_ms = wall * 1e3 / args.steps
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = wall * 1e6  # shares of the whole step: the rest is outside torch ops
    print(f"  profiled {args.steps} steps: {step_ms:.2f} ms/step under the profiler "
          f"(its own overhead included); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("  | op | % of step | ms/step | calls/step |")
    print("  |---|---|---|---|")
    for e in events[: args.top]:
        print(f"  | {e.key} | {100 * e.self_cpu_time_total / total_us:.1f} | "
              f"{e.self_cpu_time_total / 1e3 / args.steps:.2f} | {e.count / args.steps:.0f} |")
    rest = sum(e.self_cpu_time_total for e in events[args.top:])
    print(f"  | (all other ops) | {100 * rest / total_us:.1f} | {rest / 1e3 / args.steps:.2f} | |")
    outside = total_us - sum(e.self_cpu_time_total for e in events)
    print(f"  | (outside torch ops: Python, the native ctypes kernels, scheduler, sampler) | "
          f"{100 * outside / total_us:.1f} | {outside / 1e3 / args.steps:.2f} | |")
    if stack is not None:
        phases = stack.timings()
        stack.profile(False)
        print(f"  decode stack (all {len(llm.engine.executor.model.layers)} layers in one native call), "
              f"by phase:")
        print("  | phase | % of step | ms/step |")
        print("  |---|---|---|")
        for name, sec in phases.items():
            print(f"  | {name} | {100 * sec * 1e6 / total_us:.1f} | {sec * 1e3 / args.steps:.2f} |")
        inside = sum(phases.values())
        print(f"  | (the stack in all) | {100 * inside * 1e6 / total_us:.1f} | "
              f"{inside * 1e3 / args.steps:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"some of {', '.join(CASES)}")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=48, help="decode steps under the profiler")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--no-profile", action="store_true", help="speed only")
    ap.add_argument("--activation-quantization", default="none", choices=["none", "int8"],
                    help="the engine's --activation-quantization")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    ap.add_argument("--seeded", action="store_true", help="a seed per request (with --temperature)")
    ap.add_argument("--baseline", default=None,
                    help="a git revision: compare this engine's step cost with that one's")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (--baseline)")
    args = ap.parse_args()
    if args.baseline:
        compare_with_baseline(args)
        return
    from quire import LLM, SamplingParams
    for case in args.cases.split(","):
        dtype, batch = CASES[case]
        kw = {"num_threads": args.num_threads} if args.num_threads else {}
        llm = LLM(dtype=dtype, activation_quantization=args.activation_quantization, **kw)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        with StealMeter() as steal:
            step_s, overhead_s, steps = decode_speed(llm, batch, args)
        how = (f", temperature {args.temperature}, top-p {args.top_p}"
               f"{' seeded' if args.seeded else ''}" if args.temperature else "")
        print(f"{case} ({dtype}, batch {batch}{how}): {step_s * 1e3:.2f} ms per decode step, "
              f"{overhead_s * 1e3:.3f} ms of it outside the forward, "
              f"{batch / step_s:.1f} tok/s over {steps} steps, {steal}")
        if not args.no_profile:
            profile(llm, batch, args)
        llm.engine.shutdown()


def compare_with_baseline(args) -> None:
    """This checkout and `args.baseline`, each case in a fresh process, rounds alternating
    (so a drift of the host shows as spread, not as a ratio); medians per case."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    engines = {"this": os.path.join(root, "runtime"), args.baseline: runtime_snapshot(args.baseline)}
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name, path in engines.items():
            for case in args.cases.split(","):
                cmd = [sys.executable, os.path.abspath(__file__), "--cases", case,
                       "--no-profile", "--prompt-len", str(args.prompt_len),
                       "--max-tokens", str(args.max_tokens)]
                if args.num_threads:
                    cmd += ["--num-threads", str(args.num_threads)]
                cmd += ["--temperature", str(args.temperature), "--top-p", str(args.top_p)]
                cmd += ["--seeded"] if args.seeded else []
                cmd += ["--activation-quantization", args.activation_quantization]
                env = dict(os.environ, PYTHONPATH=path)
                out = subprocess.run(cmd, env=env, check=True, capture_output=True,
                                     text=True).stdout
                found = re.search(r"([0-9.]+) ms per decode step, ([0-9.]+) ms of it outside", out)
                ms, outside = float(found.group(1)), float(found.group(2))
                times.setdefault((name, case, "step"), []).append(ms)
                times.setdefault((name, case, "overhead"), []).append(outside)
                print(f"round {r + 1} {name:>10} {case}: {ms:.2f} ms/step, "
                      f"{outside:.3f} outside the forward", flush=True)
    for case in args.cases.split(","):
        for what, label in (("step", "the whole step"), ("overhead", "outside the forward")):
            new, old = times[("this", case, what)], times[(args.baseline, case, what)]
            print(f"{case}, {label}: this {statistics.median(new):.3f} ms, {args.baseline} "
                  f"{statistics.median(old):.3f} ms, ratio "
                  f"{statistics.median(new) / statistics.median(old):.3f} (median of "
                  f"{args.rounds}; spread this {min(new):.3f}-{max(new):.3f}, {args.baseline} "
                  f"{min(old):.3f}-{max(old):.3f})")


if __name__ == "__main__":
    main()
