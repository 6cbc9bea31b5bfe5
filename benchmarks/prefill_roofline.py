"""Prefill against the machine's own GEMM peak: a long prompt's tokens/s and achieved GFLOP/s
for each weight format (float32, bfloat16, int8, int4, the GGUF as shipped), each native ISA
build this CPU runs, beside torch's float32 and bfloat16 GEMM rates measured in the same run.

The peak is torch's matmul at 2048^3 and at the model's own widest shape ([prompt, hidden] x
[hidden, intermediate]) with the same threads; the achieved rate counts the linear layers'
2 x weights FLOPs per token and attention's 4 x layers x heads x head_dim x (position + 1).
Each ISA build runs in a child process with $QUIRE_CPU_ISA set (quire/native/loader.py), so
every kernel is that build's; the float formats use torch's GEMM whatever the build.

    python benchmarks/prefill_roofline.py
    python benchmarks/prefill_roofline.py --prompt-len 512 --formats gguf int4 --plot
    python benchmarks/prefill_roofline.py --formats gguf gguf-matrix --isa native   # AMX
    python benchmarks/prefill_roofline.py --formats gguf-matrix --isa amx --breakdown  # by op
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars

FORMATS = {  # name -> LLM keyword arguments
    "float32": {"dtype": "float32", "quantization": "none"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"dtype": "auto", "quantization": "int8"},
    "int4": {"dtype": "auto", "quantization": "int4"},
    "gguf": {"dtype": "auto", "quantization": "auto"},
    # the GGUF in bfloat16 with prefill on the matrix engine (native/matrix_engine.py:
    # on an AMX build the library's tiles over dequantized weights, else oneDNN)
    "gguf-matrix": {"dtype": "bfloat16", "quantization": "auto"},
    # the GGUF with x rounded to int8 (--activation-quantization int8: VNNI rows, or the AMX
    # int8 tiles on an amx build)
    "gguf-int8": {"dtype": "auto", "quantization": "auto", "activation_quantization": "int8"},
}
MATRIX_FORMATS = {"gguf-matrix"}
# $QUIRE_MATRIX_ENGINE by format: `gguf` is the exact per-group kernel (0), `gguf-matrix` the
# matrix engine on any CPU (1); every other format runs as a server runs it (auto: on an AMX
# build int8 / int4 prefill takes the dequantized tiles, a bfloat16 weight the tiles too)
ENGINE = {"gguf": "0", "gguf-matrix": "1"}


def gemm_rates(threads: int, shape: tuple[int, int, int]) -> dict[str, float]:
    """GFLOP/s of torch.matmul by dtype: the best of a square 2048^3 and the model's shape."""
    import torch
    torch.set_num_threads(threads)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        best = 0.0
        for m, k, n in ((2048, 2048, 2048), shape):
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            a @ b[:, :64]  # warm-up (the library's first call)
            reps, start = 0, time.perf_counter()
            while reps == 0 or time.perf_counter() - start < 1.0:
                a @ b
                reps += 1
            best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9)
            if best < 20:  # no native GEMM for this dtype here (bf16 on AVX2): one is enough
                break
        out[str(dtype).removeprefix("torch.")] = best
    return out


def flops_per_token(cfg, prompt_len: int) -> float:
    """Linear layers (2 x weights) plus attention (QK and PV) averaged over the prompt."""
    h, layers = cfg.hidden_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear = layers * (h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size)
    attention = layers * 4 * q * (prompt_len + 1) / 2
    return 2 * linear + attention


def time_ops() -> dict[str, float]:
    """Wraps the ops a prefill spends its time in with timers (seconds, summed per op)."""
    import functools

    from quire.attention import torch_backend
    from quire.layers import vocab_parallel
    from quire.native import fused_ops, matrix_engine, quant_matmul

    spent = dict.fromkeys(OPS, 0.0)

    def wrap(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - start
        setattr(owner, name, timed)

    wrap(matrix_engine, "linear", "matmuls on the matrix engine")
    wrap(matrix_engine, "silu_and_mul", "matmuls on the matrix engine")
    wrap(quant_matmul, "_linear", "matmuls on the native kernel")
    wrap(torch_backend.TorchAttentionBackend, "forward", "attention (KV write included)")
    wrap(fused_ops, "rms_norm", "residual + RMSNorm")
    wrap(fused_ops, "rope_", "RoPE")
    wrap(fused_ops, "silu_and_mul", "SiLU-and-mul (where not fused)")
    wrap(vocab_parallel.VocabParallelEmbedding, "lookup", "embedding lookup")
    return spent


# (matrix_engine's gate|up with its SiLU fused counts as a matmul)
OPS = ["matmuls on the matrix engine", "matmuls on the native kernel",
       "attention (KV write included)", "residual + RMSNorm", "RoPE",
       "SiLU-and-mul (where not fused)", "embedding lookup"]


def child(args) -> None:
    """One ISA build: every format's prefill, as JSON lines."""
    import random

    from quire import LLM, SamplingParams
    rng = random.Random(0)
    spent = time_ops() if args.breakdown else None
    for name in args.formats:
        os.environ["QUIRE_MATRIX_ENGINE"] = ENGINE.get(name, "auto")
        llm = LLM(args.model, num_threads=args.threads, enable_prefix_caching=False,
                  kv_cache_memory=256 << 20, max_num_batched_tokens=args.prompt_len,
                  **FORMATS[name])
        try:
            vocab = llm.engine.model_config.vocab_size
            prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                       for _ in range(4)]
            one = SamplingParams(temperature=0, max_tokens=1)
            llm.generate([prompts[0]], one, use_tqdm=False)  # warm-up
            times = []
            if spent is not None:
                spent.update(dict.fromkeys(spent, 0.0))
            with StealMeter() as steal:
                for p in prompts[1:]:
                    start = time.perf_counter()
                    llm.generate([p], one, use_tqdm=False)
                    times.append(time.perf_counter() - start)
            cfg = llm.engine.model_config
            seconds = statistics.median(times)
            print(json.dumps({
                "format": name, "dtype": str(llm.engine.dtype).removeprefix("torch."),
                "tok_s": args.prompt_len / seconds,
                "gflops": flops_per_token(cfg, args.prompt_len) * args.prompt_len / seconds
                / 1e9, "steal": str(steal),
                "ops_ms": {k: v / len(times) * 1e3 for k, v in (spent or {}).items()},
                "prefill_ms": sum(times) / len(times) * 1e3}), flush=True)
        finally:
            llm.engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", nargs="+", default=None, choices=list(FORMATS),
                   help="default: all (bfloat16 only where torch multiplies it natively)")
    p.add_argument("--isa", nargs="+", default=None,
                   help="native builds to run (default: every one this CPU runs but scalar)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the ops a prefill spends its time in (a wrapper per call)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_plot_flag(p, "prefill_roofline")
    args = p.parse_args()
    if args.child:
        child(args)
        return
    from quire.native import loader
    builds = args.isa or [b for b in loader.isa_builds() if b != "scalar"] or ["native"]
    print(describe_machine(args.threads))
    rates = gemm_rates(args.threads, (args.prompt_len, 576, 1536))
    print(f"torch GEMM, same run, {args.threads} threads: float32 {rates['float32']:.0f} "
          f"GFLOP/s, bfloat16 {rates['bfloat16']:.0f} GFLOP/s (best of 2048^3 and "
          f"{args.prompt_len}x576x1536)")
    if args.formats is None:
        bf16 = ("bfloat16", *MATRIX_FORMATS)
        args.formats = [f for f in FORMATS if f not in bf16 or rates["bfloat16"] >= 20]
        if "bfloat16" not in args.formats:
            print("bfloat16 and gguf-matrix left out: torch has no native bfloat16 GEMM on this "
                  "CPU (the engine's dtype auto is float32 here)")
    print(f"prefill of one {args.prompt_len}-token prompt (median of 3, prefix caching off):")
    rows = {}
    for build in builds:
        env = {**os.environ, "QUIRE_CPU_ISA": build} if build != "native" else dict(os.environ)
        cmd = [sys.executable, __file__, "--child", "--prompt-len", str(args.prompt_len),
               "--threads", str(args.threads), "--formats", *args.formats]
        if args.model:
            cmd += ["--model", args.model]
        if args.breakdown:
            cmd += ["--breakdown"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"  {build}: failed\n{done.stderr[-2000:]}")
            continue
        for line in done.stdout.splitlines():
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            peak = rates.get(r["dtype"], rates["float32"])
            r["share"] = r["gflops"] / peak
            rows[f"{r['format']} ({build})"] = r
            print(f"  {r['format']:<11} {build:<12} {r['dtype']:<9} {r['tok_s']:8.0f} tok/s "
                  f"{r['gflops']:6.0f} GFLOP/s = {r['share']:4.0%} of the {r['dtype']} GEMM "
                  f"peak | {r['steal']}", flush=True)
            for op, ms in r["ops_ms"].items():
                if ms:
                    print(f"      {op:<46} {ms:7.1f} ms = {ms / r['prefill_ms']:4.0%} of a "
                          f"prefill ({r['prefill_ms']:.0f} ms)")
    if args.plot and rows:
        grouped_bars(args.plot, f"Prefill ({args.prompt_len} tokens) against the GEMM peak",
                     "% of the same-run GEMM peak", ["share"],
                     {k: [100 * r["share"]] for k, r in rows.items()},
                     caption=machine_caption(args.threads))


if __name__ == "__main__":
    main()
