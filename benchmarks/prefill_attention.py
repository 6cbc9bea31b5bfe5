"""Prefill attention on the AMX tiles against what the torch backend would run without it:
torch's SDPA for a fresh prompt, and for a chunk over a cached prefix the paged extend kernel
(reading K/V in place; what the backend used below 256 new rows) and SDPA on gathered K/V.

One layer's attention on the default model's heads (9 query heads, 3 KV heads, head_dim 64,
bfloat16), median of --rounds rounds, the paths alternated round by round in one process;
the kernel's gather of a cached prefix is counted in its time, as the backend pays it.

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


def fresh_cases(lengths: list[int]) -> dict:
    """name -> {path: call}: a fresh prompt of each length, q/k/v views of one projection."""
    from quire.native import prefill_attention as pa
    cases = {}
    for n in lengths:
        qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM).bfloat16()
        q = qkv[:, :HEADS * HEAD_DIM].view(n, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(n, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(n, KV_HEADS, HEAD_DIM)
        out = torch.empty(n, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        cases[f"fresh {n}"] = {
            "AMX kernel": lambda q=q, k=k, v=v, out=out: pa.causal(q, k, v, out, HEAD_DIM ** -0.5),
            "SDPA": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, enable_gqa=True),
        }
    return cases


def extend_cases(rows: list[int], context: int) -> dict:
    """name -> {path: call}: `rows` new tokens over a cached prefix, `context` tokens in all,
    K/V in scattered cache blocks."""
    from quire.attention import paged_extend
    from quire.attention.torch_backend import gather_blocks
    from quire.native import prefill_attention as pa
    blocks = context // BLOCK
    k_cache = torch.randn(blocks + 8, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks + 8)[:blocks].to(torch.int32)[None]
    ids = table[0].long()
    cases = {}
    for n in rows:
        q = torch.randn(n, HEADS, HEAD_DIM).bfloat16()
        out = torch.empty_like(q)
        row_ids = torch.arange(n, dtype=torch.int32)
        lens = torch.arange(context - n + 1, context + 1, dtype=torch.int32)
        mask = torch.arange(context)[None] <= torch.arange(context - n, context)[:, None]

        def gathered():
            k = gather_blocks(k_cache, ids, 1.0, torch.bfloat16).view(-1, KV_HEADS, HEAD_DIM)
            v = gather_blocks(v_cache, ids, 1.0, torch.bfloat16).view(-1, KV_HEADS, HEAD_DIM)
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

        cases[f"{n} over {context}"] = {"AMX kernel": kernel, "paged extend": paged,
                                        "SDPA": sdpa}
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
    add_plot_flag(ap, "prefill_attention")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from quire.native import prefill_attention as pa
    print(describe_machine(args.threads))
    if not pa.available():
        print("no AMX prefill attention kernel on this CPU (it needs amx_bf16): the torch "
              "backend keeps SDPA and the paged extend here")
        return
    cases = {**fresh_cases(args.fresh), **extend_cases(args.extend, args.context)}
    times = {(c, p): [] for c, paths in cases.items() for p in paths}
    with StealMeter() as steal:
        for _ in range(args.rounds):
            for c, paths in cases.items():
                for p, fn in paths.items():
                    times[c, p].append(timed(fn))
    print(f"one layer's attention, {HEADS} heads over {KV_HEADS} KV heads, head_dim "
          f"{HEAD_DIM}, bfloat16, {args.threads} threads; median of {args.rounds} rounds, "
          f"us; {steal}")
    print("| chunk | AMX kernel | paged extend | SDPA | SDPA / kernel |")
    print("|---|---|---|---|---|")
    medians = {key: statistics.median(v) for key, v in times.items()}
    for c, paths in cases.items():
        cell = {p: f"{medians[c, p]:.0f}" for p in paths}
        print(f"| {c} | {cell['AMX kernel']} | {cell.get('paged extend', '-')} | "
              f"{cell['SDPA']} | {medians[c, 'SDPA'] / medians[c, 'AMX kernel']:.2f}x |")
    if args.plot:
        names = list(cases)
        series = {p: [medians.get((c, p), 0.0) / medians[c, "SDPA"] for c in names]
                  for p in ("AMX kernel", "paged extend")}
        grouped_bars(args.plot, "prefill attention, one layer: time against SDPA's (1.0)",
                     "x SDPA's time", names, series, caption=machine_caption(args.threads))


if __name__ == "__main__":
    main()
