"""Weight-only int8/int4 matmul kernels on the default model's shapes: us per call and the
weight bytes read per second, beside the float paths (fp32 F.linear, bf16 oneDNN-packed).

Every kernel that runs here is timed: `dequant` (dequantize once, fp32 matmul), torch's
`_weight_int8pack_mm` (per channel) and `_weight_int4pack_mm_for_cpu` (group 32), and the
native kernels (native/quant_matmul.py) when they are built. GB/s counts the
weight's bytes in its own format (what a decode step must stream), not the activations.

    python benchmarks/quant_kernels.py [--m 1 8 32 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from quire.layers import quant_formats as qf
from quire.layers import quant_kernels
from quire.native import packed_linear

# SmolLM2-135M: fused qkv, o, fused gate/up, down, the tied LM head (N, K)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def timed(fn, x, min_time=0.3) -> float:
    fn(x)
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_time or n < 3:
        fn(x)
        n += 1
    return elapsed / n * 1e6


def candidates(w: torch.Tensor):
    """name -> (callable on x, weight bytes read per call)."""
    n, k = w.shape
    out = {"fp32 F.linear": (lambda x, w=w: F.linear(x.float(), w), 4 * n * k)}
    wb = w.to(torch.bfloat16)
    packed = packed_linear.pack(wb)
    if packed is not None:
        out["bf16 packed"] = (lambda x: packed_linear.linear(x.to(torch.bfloat16), packed, None),
                              2 * n * k)
    q8, s8 = qf.quantize_int8(w)
    q8g, s8g = qf.quantize_int8(w, 32)
    q4, s4, z4 = qf.quantize_int4(w, 32)
    int8_bytes, int8g_bytes = n * k + 4 * n, n * k + 4 * n * k // 32
    int4_bytes = n * k // 2 + 8 * n * k // 32
    for prefer in ("native", "torch", "dequant"):
        for label, make, tensors, nbytes in (
                ("int8/ch", quant_kernels.int8_kernel, (q8, s8), int8_bytes),
                ("int8/g32", quant_kernels.int8_kernel, (q8g, s8g), int8g_bytes),
                ("int4/g32", quant_kernels.int4_kernel, (q4, s4, z4), int4_bytes)):
            kernel = make(*tensors, exact=prefer != "torch", prefer=prefer)
            if kernel.name.startswith(prefer[:4]) or (prefer == "dequant"
                                                        and kernel.name == "dequant"):
                out[f"{label} {kernel.name}"] = (kernel, nbytes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 512])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"threads {torch.get_num_threads()}, activations {args.dtype}, native kernels "
          f"{'built' if quant_kernels.native() else 'not available'}")
    print(f"{'shape':<8} {'N x K':<12} {'M':>4}  {'kernel':<26} {'us/call':>10} {'GB/s':>7}")
    torch.manual_seed(0)
    for shape in args.shapes:
        n, k = SHAPES[shape]
        w = torch.randn(n, k) * 0.05
        for name, (fn, nbytes) in candidates(w).items():
            for m in args.m:
                x = torch.randn(m, k).to(dtype)
                us = timed(fn, x)
                print(f"{shape:<8} {f'{n}x{k}':<12} {m:>4}  {name:<26} {us:>10.1f} "
                      f"{nbytes / us / 1e3:>7.2f}")


if __name__ == "__main__":
    main()
