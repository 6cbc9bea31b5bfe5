"""Prefill attention's paths side by side: the AMX tile kernel (AMX builds), the paged extend
kernel (reading K/V in place through the block table: GEMM-shaped tiles of rows on the AVX2
and AVX-512 builds) and torch's SDPA, for a fresh prompt and for a chunk over a cached prefix
(SDPA on gathered K/V). The torch backend picks among them (attention/torch_backend.py).

One layer's attention on the default model's heads (9 query heads, 3 KV heads, head_dim 64,
bfloat16 unless --dtype), median of --rounds rounds, the paths alternated round by round in
one process; a gather of a cached prefix is counted in its path's time, as the backend pays
it. QUIRE_CPU_ISA picks the paged kernel's build; ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 keeps
SDPA's GEMMs off AMX (what a CPU without it runs).

    python benchmarks/prefill_attention.py
    python benchmarks/prefill_attention.py --fresh 128 512 2048 --extend 16 64 256 --plot
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def timed(fn, seconds: float = 0.25) -> float:
    """Microseconds a call, over at least `seconds` of calls."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls == 0 or time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def fresh_cases(lengths: list[int], dtype: torch.dtype, amx: bool) -> dict:
    """name -> {path: call}: a fresh prompt of each length, q/k/v views of one projection (the
    paged extend reads the same prompt's K/V from cache blocks)."""
    from quire.native import prefill_attention as pa
    cases = {}
    for n in lengths:
        qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
        q = qkv[:, :HEADS * HEAD_DIM].view(n, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(n, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(n, KV_HEADS, HEAD_DIM)
        out = torch.empty(n, HEADS, HEAD_DIM, dtype=dtype)
        paths = {"SDPA": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, enable_gqa=True)}
        if amx:
            paths["AMX kernel"] = lambda q=q, k=k, v=v, out=out: pa.causal(q, k, v, out,
                                                                           HEAD_DIM ** -0.5)
        paths["paged extend"] = extend_cases([n], -(-n // BLOCK) * BLOCK, dtype, False,
                                             q=q)[f"{n} over {-(-n // BLOCK) * BLOCK}"][
                                                 "paged extend"]
        cases[f"fresh {n}"] = paths
    return cases


def extend_cases(rows: list[int], context: int, dtype: torch.dtype, amx: bool,
                 q: torch.Tensor | None = None) -> dict:
    """name -> {path: call}: `rows` new tokens over a cached prefix, `context` tokens in all,
    K/V in scattered cache blocks."""
    from quire.attention import paged_extend
    from quire.attention.torch_backend import gather_blocks
    from quire.native import prefill_attention as pa
    blocks = context // BLOCK
    k_cache = torch.randn(blocks + 8, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks + 8)[:blocks].to(torch.int32)[None]
    ids = table[0].long()
    cases = {}
    for n in rows:
        q = torch.randn(n, HEADS, HEAD_DIM).to(dtype) if q is None else q
        out = torch.empty(n, HEADS, HEAD_DIM, dtype=dtype)
        row_ids = torch.arange(n, dtype=torch.int32)
        lens = torch.arange(context - n + 1, context + 1, dtype=torch.int32)
        mask = torch.arange(context)[None] <= torch.arange(context - n, context)[:, None]

        def gathered():
            k = gather_blocks(k_cache, ids, 1.0, dtype).view(-1, KV_HEADS, HEAD_DIM)
            v = gather_blocks(v_cache, ids, 1.0, dtype).view(-1, KV_HEADS, HEAD_DIM)
            return k[:context], v[:context]

        def kernel(q=q, out=out):
            k, v = gathered()
            pa.causal(q, k, v, out, HEAD_DIM ** -0.5)

        def sdpa(q=q, mask=mask):
            k, v = gathered()
            F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask,
                                           enable_gqa=True)

        def paged(q=q, out=out, row_ids=row_ids, lens=lens):
            paged_extend.paged_extend(q, k_cache, v_cache, out, table, row_ids,
                                      torch.zeros_like(row_ids), lens, HEAD_DIM ** -0.5, None)

        paths = {"SDPA": sdpa, "paged extend": paged}
        if amx:
            paths["AMX kernel"] = kernel
        cases[f"{n} over {context}"] = paths
        q = None
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh", type=int, nargs="+", default=[128, 512, 2048],
                    help="fresh prompt lengths")
    ap.add_argument("--extend", type=int, nargs="+", default=[16, 64, 256],
                    help="new rows over a cached prefix")
    ap.add_argument("--context", type=int, default=2048, help="tokens in all, for --extend")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    add_plot_flag(ap, "prefill_attention")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from quire.attention import paged_extend
    from quire.native import prefill_attention as pa
    dtype = getattr(torch, args.dtype)
    print(describe_machine(args.threads))
    amx = pa.available() and dtype == torch.bfloat16
    tiled = paged_extend._tiled(HEADS, KV_HEADS, HEAD_DIM, BLOCK)
    print(f"AMX prefill attention kernel: {'yes' if amx else 'no'}; paged extend "
          f"{'in tiles of rows' if tiled else 'row by row'}")
    cases = {**fresh_cases(args.fresh, dtype, amx),
             **extend_cases(args.extend, args.context, dtype, amx)}
    times = {(c, p): [] for c, paths in cases.items() for p in paths}
    with StealMeter() as steal:
        for _ in range(args.rounds):
            for c, paths in cases.items():
                for p, fn in paths.items():
                    times[c, p].append(timed(fn))
    print(f"one layer's attention, {HEADS} heads over {KV_HEADS} KV heads, head_dim "
          f"{HEAD_DIM}, {args.dtype}, {args.threads} threads; median of {args.rounds} rounds, "
          f"us; {steal}")
    print("| chunk | AMX kernel | paged extend | SDPA | SDPA / the faster kernel |")
    print("|---|---|---|---|---|")
    medians = {key: statistics.median(v) for key, v in times.items()}
    for c, paths in cases.items():
        cell = {p: f"{medians[c, p]:.0f}" for p in paths}
        best = min(medians[c, p] for p in paths if p != "SDPA")
        print(f"| {c} | {cell.get('AMX kernel', '-')} | {cell['paged extend']} | "
              f"{cell['SDPA']} | {medians[c, 'SDPA'] / best:.2f}x |")
    if args.plot:
        names = list(cases)
        series = {p: [medians.get((c, p), 0.0) / medians[c, "SDPA"] for c in names]
                  for p in ("AMX kernel", "paged extend")}
        grouped_bars(args.plot, "prefill attention, one layer: time against SDPA's (1.0)",
                     "x SDPA's time", names, series, caption=machine_caption(args.threads))


if __name__ == "__main__":
    main()
