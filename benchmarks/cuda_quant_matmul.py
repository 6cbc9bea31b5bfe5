"""The Triton weight-only int8/int4 matmul (layers/triton_quant.py) on a CUDA GPU, beside
torch's bf16 matmul on the same shapes: us per call and weight GB/s (the weight's bytes in its
own format, what a decode step must stream), against the GPU's memory bandwidth.

`ieee` multiplies in fp32 (the engine's default: dequantize-then-matmul's values); `fast`
multiplies in the activation dtype on tensor cores.

    python benchmarks/cuda_quant_matmul.py [--m 1 16 256] [--group 64]
"""

from __future__ import annotations

import argparse
import sys

import torch

# Llama-3-8B: fused qkv, o, fused gate/up, down (N, K)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--group", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU")
        return 2
    import triton.testing

    from quire.layers import quant_formats as qf
    from quire.layers.triton_quant import quant_matmul
    print(f"device: {torch.cuda.get_device_name()}; activations bf16; int4 group "
          f"{args.group}")
    print(f"{'shape':>8} {'M':>4} {'kernel':>10} {'us':>9} {'weight GB/s':>12} "
          f"{'max rel err':>12}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        q8, s8 = qf.quantize_int8(w)
        q4, s4, z4 = qf.quantize_int4(w, args.group)
        dense = {"int8": qf.dequantize_int8(q8, s8), "int4": qf.dequantize_int4(q4, s4, z4)}
        wb = w.to(torch.bfloat16)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            runs = {"bf16": (lambda: x @ wb.T, wb.numel() * 2, None)}
            for kind, (q, s, z) in {"int8": (q8, s8, None), "int4": (q4, s4, z4)}.items():
                nbytes = q.numel() * q.element_size() + s.numel() * 4 \
                    + (z.numel() * 4 if z is not None else 0)
                for fast in (False, True):
                    label = f"{kind}-{'fast' if fast else 'ieee'}"
                    runs[label] = (lambda q=q, s=s, z=z, fast=fast:
                                   quant_matmul(x, q, s, z, fast=fast), nbytes, kind)
            for label, (fn, nbytes, kind) in runs.items():
                err = ""
                if kind is not None:
                    want = x.float() @ dense[kind].T
                    err = f"{((fn().float() - want).abs().max() / want.abs().max()).item():.1e}"
                us = triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3
                print(f"{name:>8} {m:>4} {label:>10} {us:>9.1f} {nbytes / us / 1e3:>12.0f} "
                      f"{err:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
