"""The Triton weight-only int8/int4 matmul (layers/triton_quant.py) on a CUDA GPU, beside
torch's bf16 matmul on the same shapes: us per call and weight GB/s (the weight's bytes in its
own format, what a decode step must stream), against the GPU's memory bandwidth.

Paths (triton_quant.py says what each does): gemv (decode rows), dequant (dequantize, then
cuBLAS), fused and fused-fast (tl.dot on dequantized tiles, fp32 / activation dtype). `auto`
is what the engine runs. Then a sweep of the gemv's tile sizes at decode M.

    python benchmarks/cuda_quant_matmul.py [--m 1 2 4 9 64 512] [--group 64] [--no-sweep]

Each row also gives its TFLOP/s (beside cuBLAS's bf16 rate on 8192^3, measured first) and, for
the engine's `auto` path, its time against the first M's: what verifying k + 1 rows costs
against one decode row.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch

# Llama-3-8B: fused qkv, o, fused gate/up, down (N, K)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def weights(n: int, k: int, group: int):
    from quire.layers import quant_formats as qf
    w = torch.randn(n, k, device="cuda") * 0.02
    q8, s8 = qf.quantize_int8(w)
    q4, s4, z4 = qf.quantize_int4(w, group)
    return w.to(torch.bfloat16), {
        "int8": ((q8, s8, None), qf.dequantize_int8(q8, s8)),
        "int4": ((q4, s4, z4), qf.dequantize_int4(q4, s4, z4))}


def nbytes(q, s, z) -> int:
    return sum(t.numel() * t.element_size() for t in (q, s, z) if t is not None)


def table(args, bench) -> None:
    from quire.layers.triton_quant import quant_matmul
    peak = bench(partial(torch.matmul, *(torch.randn(8192, 8192, device="cuda",
                                                     dtype=torch.bfloat16),) * 2))
    peak_tflops = 2 * 8192 ** 3 / peak / 1e6
    print(f"bf16 cuBLAS 8192^3: {peak_tflops:.0f} TFLOP/s (the tensor-core rate this run "
          f"reaches)")
    print(f"{'shape':>8} {'M':>4} {'kernel':>16} {'us':>9} {'weight GB/s':>12} "
          f"{'max rel err':>12} {'TFLOP/s':>8} {'x M=' + str(args.m[0]):>7}")
    auto_us: dict[tuple[str, str, int], float] = {}
    for name, (n, k) in SHAPES.items():
        wb, quant = weights(n, k, args.group)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = bench(partial(torch.matmul, x, wb.T))
            print(f"{name:>8} {m:>4} {'bf16 cuBLAS':>16} {us:>9.1f} "
                  f"{wb.numel() * 2 / us / 1e3:>12.0f} {'':>12} {2 * m * n * k / us / 1e6:>8.1f}")
            for kind, (qsz, dense) in quant.items():
                want = x.float() @ dense.T
                paths = ["auto", "dequant", "fused", "fused-fast"]
                if m <= 8:
                    paths.insert(1, "gemv")
                for path in paths:
                    fn = partial(quant_matmul, x, *qsz, path=path)
                    err = ((fn().float() - want).abs().max() / want.abs().max()).item()
                    us = bench(fn)
                    if path == "auto":
                        auto_us[name, kind, m] = us
                    ratio = (us / auto_us[name, kind, args.m[0]]
                             if path == "auto" and (name, kind, args.m[0]) in auto_us else None)
                    print(f"{name:>8} {m:>4} {kind + ' ' + path:>16} {us:>9.1f} "
                          f"{nbytes(*qsz) / us / 1e3:>12.0f} {err:>12.1e} "
                          f"{2 * m * n * k / us / 1e6:>8.1f} "
                          + (f"{ratio:>7.2f}" if ratio is not None else ""))


def sweep(args, bench) -> None:
    from quire.layers import quant_formats as qf
    from quire.layers import triton_quant
    print("\ngemv tiles at M = 1 (split_k automatic; int4 tiles wider than a group load each "
          "row's scale and zero once per group)")
    print(f"{'shape':>8} {'kind':>10} {'block_n':>8} {'block_k':>8} {'us':>8} {'GB/s':>6}")
    for name in ("qkv", "gate_up"):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda") * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        kinds = {"int8": (*qf.quantize_int8(w), None)}
        if name == "gate_up":
            kinds[f"int4 g{args.group}"] = qf.quantize_int4(w, args.group)
        for kind, qsz in kinds.items():
            tiles = ([(bn, bk) for bn in (4, 8, 16) for bk in (256, 512, 1024)]
                     if kind == "int8" else
                     [(bn, bk) for bn in (4, 8, 16, 32) for bk in (32, 128, 256, 512, 1024)])
            for block_n, block_k in tiles:
                us = bench(partial(triton_quant.gemv, x, *qsz, block_n=block_n,
                                   block_k=block_k))
                print(f"{name:>8} {kind:>10} {block_n:>8} {block_k:>8} {us:>8.1f} "
                      f"{nbytes(*qsz) / us / 1e3:>6.0f}")
    n, k = SHAPES["gate_up"]
    w = torch.randn(n, k, device="cuda") * 0.02
    q4 = qf.quantize_int4(w, args.group)
    print(f"\nint4 g{args.group} gate_up: fused-fast tiles (batched decode) and the dequantize "
          f"kernel's K tile (prefill)")
    print(f"{'kernel':>12} {'M':>4} {'block_n':>8} {'block_k':>8} {'us':>8} {'GB/s':>6}")
    for m in (8, 32):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for block_n in (32, 64, 128):
            for block_k in (32, 64, 128, 256):
                us = bench(partial(triton_quant.fused, x, *q4, fast=True, block_n=block_n,
                                   block_k=block_k))
                print(f"{'fused-fast':>12} {m:>4} {block_n:>8} {block_k:>8} {us:>8.1f} "
                      f"{nbytes(*q4) / us / 1e3:>6.0f}")
    for block_k in (32, 64, 128, 256):
        us = bench(partial(triton_quant.dequantize, *q4, dtype=torch.bfloat16,
                           block_k=block_k))
        print(f"{'dequant':>12} {'-':>4} {'auto':>8} {block_k:>8} {us:>8.1f} "
              f"{nbytes(*q4) / us / 1e3:>6.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 1-9 rows: a decode step and the verification of up to 8 proposals (issue 48: k + 1 rows
    # within 1.5x of one); 64 and 512: batched decode and prefill against the tensor cores
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 9, 64, 512])
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU")
        return 2
    import triton.testing

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3

    print(f"device: {torch.cuda.get_device_name()}; activations bf16; int8 per channel, int4 "
          f"group {args.group}")
    table(args, bench)
    if not args.no_sweep:
        sweep(args, bench)
    return 0


if __name__ == "__main__":
    sys.exit(main())
