"""Weight-only int8 / int4 matmul on the CPU: Quire's native kernels (native/quant_matmul)
against torch's own (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) and dense F.linear, on
SmolLM2-135M's shapes, with the machine's measured read bandwidth as the bound to read the
decode (small M) figures against.

    python benchmarks/quant_matmul.py                 # bf16 activations, M = 1, 8, 32, 512
    python benchmarks/quant_matmul.py --dtype float32 --m 1 8

Per row: microseconds per call (best of --trials, each the mean of a timed loop) and the
effective GB/s of weight read (the packed weight's bytes, scales included, over the time):
at M = 1 a kernel reads every weight once, so GB/s against the streaming figure says how
close to memory-bound it is.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
from machine import StealMeter

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 KV heads of 64, vocab 49152
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576)]
LAYERS = 30  # SmolLM2-135M: each decode step runs the four layer shapes 30 times, lm_head once


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"]
    return f"{model}; " + " ".join(f for f in wanted if f in flags)


def best_time(fn, trials: int, seconds: float = 0.002) -> float:
    """Seconds per call: the best of `trials` short timed loops (about `seconds` each). On a
    shared machine the best short loop is the one that ran undisturbed."""
    fn()
    start, loops = time.perf_counter(), 0
    while loops == 0 or time.perf_counter() - start < seconds:
        fn()
        loops += 1
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - start) / loops)
    return best


def read_bandwidth(qm, threads: int, trials: int) -> float:
    """GB/s of a streaming read of 256 MiB (far beyond the caches) with `threads` threads."""
    buf = torch.ones(256 << 20, dtype=torch.uint8)
    lib = qm._library()
    t = best_time(lambda: lib.quire_stream_read(buf.data_ptr(), buf.numel(), threads),
                  max(3, trials // 5), seconds=0)
    return buf.numel() / t / 1e9


def torch_int4(n: int, k: int, group: int, dtype: torch.dtype, g: torch.Generator):
    """torch's CPU int4 weight-only matmul on a random weight, or None where this torch has
    none (its layout: the weight packed by _convert_weight_to_int4pack_for_cpu, scales and
    zeros [K / group, N, 2] in x's dtype; w = (q - 8) * scale + zero, as ours)."""
    try:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = torch.stack([torch.rand(k // group, n, generator=g),
                          torch.randn(k // group, n, generator=g) * 0.01], dim=-1)
        sz = sz.to(dtype).contiguous()
        torch._weight_int4pack_mm_for_cpu(torch.randn(1, k, dtype=dtype), packed, group, sz)
    except (RuntimeError, AttributeError):
        return None
    return (lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, group, sz),
            packed.numel() * packed.element_size() + sz.numel() * sz.element_size())


def torch_int8(n: int, k: int, dtype: torch.dtype, g: torch.Generator):
    """torch's per-output-channel int8 weight-only matmul (_weight_int8pack_mm), or None."""
    try:
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        scales = torch.rand(n, generator=g).to(dtype)
        torch._weight_int8pack_mm(torch.randn(1, k, dtype=dtype), w, scales)
    except (RuntimeError, AttributeError):
        return None
    return lambda x: torch._weight_int8pack_mm(x, w, scales), n * k + n * dtype.itemsize


def _packed_int4(qm, n, k, group, g, march, gguf: bool):
    """gguf: Q4_1's float16 d and m (zero = m + 8 d); else float32 scales and zeros (int4
    quantized on load from a float checkpoint)."""
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s, z = torch.rand(n, k // group, generator=g) * 0.01, torch.randn(n, k // group) * 0.01
    if gguf:
        s = s.half().float()
        z = -(torch.rand(n, k // group, generator=g) * 0.1).half().float() + 8 * s
    return qm.pack_int4(q, s, z, group, _march=march)


def quire_int4(qm, n, k, group, g, march, gguf: bool):
    packed = _packed_int4(qm, n, k, group, g, march, gguf)
    return lambda x: qm.int4_linear(x, packed), packed.nbytes()


def quire_int4_tiles(qm, n, k, group, g, march):
    """Q4_1 by the matrix engine's road on the library's AMX tiles (`dequantized_linear`:
    bfloat16 x, the weight rounded to bfloat16 in cache; prefill's 64+ rows): None where
    the build has no tiles."""
    packed = _packed_int4(qm, n, k, group, g, march, gguf=True)
    if qm.dequantized_linear(torch.zeros(1, k, dtype=torch.bfloat16), packed, march) is None:
        return None
    return lambda x: qm.dequantized_linear(x.to(torch.bfloat16), packed, march), packed.nbytes()


def quire_int8(qm, n, k, group, g, march, gguf: bool):
    """gguf: Q8_0's float16 d; else float32 scales."""
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.01
    packed = qm.pack_int8(q, s.half().float() if gguf else s, group, _march=march)
    return lambda x: qm.int8_linear(x, packed), packed.nbytes()


def dense(n, k, dtype, g):
    w = torch.randn(n, k, generator=g).to(dtype)
    return lambda x: F.linear(x.to(dtype), w), n * k * dtype.itemsize


def contenders(qm, n: int, k: int, group4: int, dtype: torch.dtype, march: str):
    """(name, make(generator) -> (fn(x), weight bytes) or None) for each way to multiply by a
    random N x K weight."""
    return [
        (f"quire int4 g{group4} Q4_1 fp16", lambda g: quire_int4(qm, n, k, group4, g, march, True)),
        (f"quire int4 g{group4} fp32 s,z", lambda g: quire_int4(qm, n, k, group4, g, march, False)),
        (f"quire int4 g{group4} Q4_1, AMX tiles dequantized",
         lambda g: quire_int4_tiles(qm, n, k, group4, g, march)),
        ("quire int8 g32 Q8_0 fp16", lambda g: quire_int8(qm, n, k, 32, g, march, True)),
        ("quire int8 per-channel", lambda g: quire_int8(qm, n, k, k, g, march, False)),
        (f"torch int4pack g{group4}", lambda g: torch_int4(n, k, group4, dtype, g)),
        ("torch int8pack per-channel", lambda g: torch_int8(n, k, dtype, g)),
        ("F.linear bf16", lambda g: dense(n, k, torch.bfloat16, g)),
        ("F.linear fp32", lambda g: dense(n, k, torch.float32, g)),
    ]


def time_cold(make, x: torch.Tensor, cold_bytes: int, trials: int):
    """(seconds per call, weight bytes) cycling through enough copies of the weight to
    overflow the caches (a decode step reads ~100 MB of weights: each layer's come from
    DRAM), or None where the contender is missing."""
    g = torch.Generator().manual_seed(0)
    first = make(g)
    if first is None:
        return None
    nbytes = first[1]
    fns = [first[0]] + [make(g)[0] for _ in range(min(255, -(-cold_bytes // nbytes) - 1))]
    cycle = itertools.cycle(fns)
    return best_time(lambda: next(cycle)(x), trials), nbytes


def call_overhead(qm, trials: int) -> tuple[float, float]:
    """Microseconds of one int8_linear call on a 16 x 32 weight (nearly all overhead), and of
    the bare ctypes call alone."""
    packed = qm.pack_int8(torch.ones(16, 32, dtype=torch.int8), torch.ones(16, 1), 32)
    x = torch.randn(1, 32)
    y = torch.empty(1, 16)
    fn = qm._library().quire_quant_linear_packed
    bare = (x.data_ptr(), y.data_ptr(), 1, 0, 1, packed._address)
    whole = best_time(lambda: qm.int8_linear(x, packed), trials)
    ctypes_only = best_time(lambda: fn(*bare), trials)
    return whole * 1e6, ctypes_only * 1e6


def native_kernels(args):
    """torch's threads as --threads says, then the quant_matmul module with its --march build
    loaded (or exit saying why not)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    from quire.native import quant_matmul as qm
    if qm._library(args.march) is None:
        raise SystemExit("quant_matmul.cpp did not build here (no compiler?)")
    return qm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 512])
    ap.add_argument("--group", type=int, default=32, help="int4 group (and int8 G for lm_head)")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="default: torch's")
    ap.add_argument("--cold-mb", type=int, default=96,
                    help="cycle through this many MB of weight copies (0: one copy, in cache)")
    ap.add_argument("--march", default="native", help="build the kernels for this -march")
    args = ap.parse_args()
    qm = native_kernels(args)
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    print(f"CPU: {cpu_flags()}")
    print(f"kernel path: {qm.isa(args.march)} (-march={args.march}), {threads} threads, "
          f"x {args.dtype}, int4 group {args.group}")
    with StealMeter() as steal:
        bandwidth = read_bandwidth(qm, threads, args.trials)
        whole, bare = call_overhead(qm, args.trials)
        print(f"streaming read: {bandwidth:.1f} GB/s ({threads} threads, 256 MiB)")
        print(f"call overhead: int8_linear on a 16x32 weight {whole:.1f} us, of which the "
              f"ctypes call {bare:.1f} us")
        print()
        header = (f"{'layer':8} {'N':>6} {'K':>5} {'M':>4} | {'kind':<28} {'us/call':>9} "
                  f"{'GB/s':>6} {'vs bf16':>7}")
        print(header)
        print("-" * len(header))
        step: dict[str, list[float]] = {}  # kind -> [seconds, bytes] of one decode step at M=1
        at_m1: dict[tuple[str, str], tuple[float, int]] = {}  # (layer, kind) -> (s, bytes)
        for name, n, k in SHAPES:
            group4 = args.group if k % args.group == 0 else 32
            kinds = contenders(qm, n, k, group4, dtype, args.march)
            for m in args.m:
                if name == "lm_head" and m > 32:
                    continue  # the LM head only ever sees the sampled rows
                x = torch.randn(m, k, dtype=dtype)
                results = [(kind, time_cold(make, x, args.cold_mb << 20, args.trials))
                           for kind, make in kinds]
                base = dict(results)["F.linear bf16"][0]
                for kind, result in results:
                    if result is None:
                        print(f"{name:8} {n:6} {k:5} {m:4} | {kind:<28} {'n/a':>9}")
                        continue
                    t, nbytes = result
                    if m == 1:
                        times = 1 if name == "lm_head" else LAYERS
                        same = kind.replace(f"int4 g{group4}", "int4 g").replace(
                            f"int4pack g{group4}", "int4pack g")  # one row per kind below
                        at_m1[name, same] = times * t, times * nbytes
                        total = step.setdefault(same, [0.0, 0])
                        total[0] += times * t
                        total[1] += times * nbytes
                    print(f"{name:8} {n:6} {k:5} {m:4} | {kind:<28} {t * 1e6:9.1f} "
                          f"{nbytes / t / 1e9:6.1f} {base / t:6.2f}x")
            print()
    print(f"({steal}; GB/s = packed weight bytes / time; 'vs bf16' = F.linear bf16 time / "
          f"this time)")
    if step:
        print()
        print(f"Roofline, one SmolLM2-135M decode step's matmuls at M = 1 ({LAYERS} layers of the "
              f"four shapes + lm_head, each kind throughout), against the {bandwidth:.1f} GB/s "
              f"streaming read:")
        # the default model as shipped: Q4_1 layers, Q8_0 tied embedding as the LM head
        mix = [at_m1.get((name, "quire int4 g Q4_1 fp16" if name != "lm_head" else
                          "quire int8 g32 Q8_0 fp16")) for name, _, _ in SHAPES]
        if all(mix):
            step["default GGUF: Q4_1 + Q8_0 head"] = [sum(t for t, _ in mix),
                                                       sum(b for _, b in mix)]
        for kind, (t, nbytes) in step.items():
            print(f"  {kind:<28} {t * 1e3:7.2f} ms  {nbytes / 1e6:6.1f} MB  "
                  f"{nbytes / t / 1e9:5.1f} GB/s  matmul-only bound {1 / t:6.0f} tok/s  "
                  f"(bandwidth bound {bandwidth * 1e9 / nbytes:5.0f} tok/s)")


if __name__ == "__main__":
    main()
