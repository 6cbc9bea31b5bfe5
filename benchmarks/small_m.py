"""Small-M rows at one weight read: what M rows of x cost against one (decode), through every
quantized matmul of one SmolLM2-135M step, by the kernel's own timing.

A decode step multiplies one row of x per sequence; speculative verification multiplies k + 1
rows (the last token and k proposals) of one sequence, batched decode one row per sequence. A
step's weights (~75 MB as Q4_1) come from memory, so one row is bound by the read; the goal
is that k + 1 rows cost close to that one read (issue 48: <= 1.5x at the verification's rows).
Each M runs the whole step (30 layers x qkv, o, gate_up, down, then the Q8_0 lm_head) on
random weights in the kernel's layout, best of --trials steps, M values alternated round by
round in one process.

    python benchmarks/small_m.py                       # M = 1..9, 16, 32; the native build
    python benchmarks/small_m.py --m 1 5 9 --plot
    python benchmarks/small_m.py --march avx2          # one ISA build (tests/runtime builds)
    python benchmarks/small_m.py --march avx512_bf16 amx --dtype bfloat16   # builds side by side
    python benchmarks/small_m.py --weights bfloat16 --dtype bfloat16 --march avx512_bf16 amx
    python benchmarks/small_m.py --activations float int8   # --activation-quantization's two
    python benchmarks/small_m.py --march amx --dtype bfloat16 --m 1 9 --tile-costs

`--activations int8` rounds x to int8 in the int4 layers, and in the Q8_0 lm_head where the
build has AVX512-VNNI (the engine's --activation-quantization int8). `--tile-costs` (an AMX
CPU) adds what the tile unit's fixed steps cost a group of 16 weight rows x 32 k at each M
(amx_tile_costs.cpp: one thread, hot data), beside what a group of the step took per thread.
"""

from __future__ import annotations

import argparse
import time

import torch
from machine import StealMeter, fma_peak_gflops
from plotting import add_plot_flag, line_panels
from quant_matmul import LAYERS, SHAPES, cpu_flags, native_kernels

STEP_MATMULS = [(name, n, k) for name, n, k in SHAPES if name != "lm_head"] * LAYERS + [
    ("lm_head", 49152, 576)]


def make_step(qm, march: str, weights: str = "gguf"):
    """One step's packed weights: Q4_1 (float16 d, m; group 32) for the layers, Q8_0 for the
    lm_head, as the default GGUF holds them; or (`bfloat16`) a float model's bfloat16
    weights in the kernel's layout (pack_bf16: quant_kernels.DenseBf16Kernel's). On huge
    pages, as an engine holds them (QUIRE_HUGE_PAGES=0: where torch put them)."""
    g = torch.Generator().manual_seed(0)
    step = []
    for name, n, k in STEP_MATMULS:
        if weights == "bfloat16":
            w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
            step.append((qm.pack_bf16(w, _march=march), qm.bf16_linear))
            continue
        if name == "lm_head":
            q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
            s = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
            step.append((qm.pack_int8(q, s, 32, _march=march), qm.int8_linear))
            continue
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
        m = -(torch.rand(n, k // 32, generator=g) * 0.1).half().float()
        step.append((qm.pack_int4(q, d, m + 8 * d, 32, _march=march), qm.int4_linear))
    qm.move_to_huge_pages([p for p, _ in step])  # where an engine keeps them (huge_pages.py)
    return step


GROUP_TILES = sum((n + 15) // 16 * (k // 32) for _, n, k in STEP_MATMULS)  # 16 rows x 32 k
TILE_COSTS = ["products", "+ C stores", "+ C loads", "B stores", "all"]


def tile_costs(m: int) -> list[float] | None:
    """amx_tile_costs.cpp's ns a group for m rows (TILE_COSTS), or None without the tiles."""
    import ctypes
    import os

    from quire.native.loader import isa_builds, load_library

    if "amx" not in isa_builds():
        return None
    lib = load_library(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "amx_tile_costs.cpp"), "amx")
    if lib is None:
        return None
    out = (ctypes.c_double * len(TILE_COSTS))()
    return list(out) if lib.quire_amx_tile_costs(m, out) else None


def use_activations(step, activations: str) -> None:
    """int8: the int4 layers (and the int8 lm_head, with AVX512-VNNI) round x to int8
    (PackedWeight.use_int8_activations)."""
    for packed, _ in step:
        packed.use_int8_activations(activations == "int8")


def run_step(step, xs) -> None:
    for packed, fn in step:
        fn(xs[packed.k], packed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--weights", default="gguf", choices=["gguf", "bfloat16"],
                    help="the GGUF's Q4_1 / Q8_0, or a float model's bfloat16 weights")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="default: torch's")
    ap.add_argument("--march", nargs="+", default=["native"],
                    help="kernel builds (loader.ISA_BUILDS), alternated call by call")
    ap.add_argument("--activations", nargs="+", default=["float"], choices=["float", "int8"],
                    help="x as it is, or rounded to int8 (alternated)")
    ap.add_argument("--tile-costs", action="store_true",
                    help="the tile unit's fixed steps a group at each M (an AMX CPU)")
    add_plot_flag(ap, "small_m")
    args = ap.parse_args()
    marches = args.march
    qm = None
    for march in marches:
        args.march = march
        qm = native_kernels(args)
    dtype = getattr(torch, args.dtype)
    by_march = {march: make_step(qm, march, args.weights) for march in marches}
    # each (build, activations) variant: the build's packed weights, rounding x or not
    builds = [(march, act) for march in marches for act in args.activations]
    steps = {b: by_march[b[0]] for b in builds}

    def name(b) -> str:
        return qm.isa(b[0]) + (", int8 activations" if b[1] == "int8" else "")
    weight_mb = sum(p.nbytes() for p, _ in steps[builds[0]]) / 1e6
    flops_per_row = 2 * sum(n * k for _, n, k in STEP_MATMULS)
    print(f"CPU: {cpu_flags()}")
    print(f"{torch.get_num_threads()} threads, x {args.dtype}; one step: "
          f"{len(steps[builds[0]])} matmuls, {weight_mb:.1f} MB of weights")
    inputs = {m: {k: torch.randn(m, k).to(dtype) for k in (576, 1536)} for m in args.m}
    best = {(b, m): float("inf") for b in builds for m in args.m}
    with StealMeter() as steal:
        for b in builds:
            for m in args.m:
                use_activations(steps[b], b[1])
                run_step(steps[b], inputs[m])  # warm-up: scratch, threads
        for _ in range(args.trials):
            for m in args.m:
                for b in builds:
                    use_activations(steps[b], b[1])
                    start = time.perf_counter()
                    run_step(steps[b], inputs[m])
                    best[b, m] = min(best[b, m], time.perf_counter() - start)
    for b in builds:
        base = best[b, args.m[0]]
        peak = fma_peak_gflops(torch.get_num_threads(), b[0])
        print(f"\nkernel path {name(b)} (build {b[0]}); float32 FMA peak of this build: "
              + (f"{peak:.0f} GFLOP/s" if peak else "n/a"))
        print(f"{'M':>4} {'ms/step':>8} {'x M=' + str(args.m[0]):>7} {'GB/s':>6} "
              f"{'GFLOP/s':>8} {'of peak':>8} {'floor x M=1':>12}")
        for m in args.m:
            gflops = m * flops_per_row / best[b, m] / 1e9
            # the least a step of m rows can cost at the FMA peak (or its weight read)
            floor = max(m * flops_per_row / (peak * 1e9), base) / base if peak else 0
            print(f"{m:>4} {best[b, m] * 1e3:8.2f} {best[b, m] / base:7.2f} "
                  f"{weight_mb / 1e3 / best[b, m]:6.1f} {gflops:8.1f} "
                  f"{100 * gflops / peak if peak else 0:7.0f}% {floor:12.2f}")
    if args.tile_costs:
        print_tile_costs(args.m, {b: {m: best[b, m] for m in args.m} for b in builds}, name)
    print(f"steal: {steal.steal_percent}% of CPU time during the runs")
    if args.plot:
        print("plot:", line_panels(
            args.plot, f"one SmolLM2-135M step's matmuls ({args.weights} weights)",
            "M (rows of x)",
            [("ms per step", {name(b): (args.m, [best[b, m] * 1e3 for m in args.m])
                              for b in builds}),
             (f"x M={args.m[0]}", {name(b): (args.m, [best[b, m] / best[b, args.m[0]]
                                                      for m in args.m]) for b in builds})],
            caption=cpu_flags()))


def print_tile_costs(ms, best, name) -> None:
    """The tile unit's fixed steps a group (one thread, hot data) beside the step's ns a group
    a thread at each M (what every step above took, over its 16 x 32 groups)."""
    threads = torch.get_num_threads()
    rows = {m: tile_costs(m) for m in ms if m <= 16}
    if not rows or any(r is None for r in rows.values()):
        print("\ntile costs: no AMX tiles here")
        return
    print(f"\ntile unit's fixed steps, ns a group of 16 weight rows x 32 k (amx_tile_costs.cpp: "
          f"one thread, hot data); a step's {GROUP_TILES} groups at {threads} threads:")
    print(f"{'M':>4} " + " ".join(f"{c:>10}" for c in TILE_COSTS) + "  "
          + "  ".join(f"{name(b) + ' step':>24}" for b in best))
    for m, row in rows.items():
        step = "  ".join(f"{best[b][m] * 1e9 * threads / GROUP_TILES:24.1f}" for b in best)
        print(f"{m:>4} " + " ".join(f"{v:10.1f}" for v in row) + "  " + step)


if __name__ == "__main__":
    main()
