"""Interactive time to first token under a batch flood, with and without priorities.

    python benchmarks/priority.py                        # the default model, one server
    python benchmarks/priority.py --model /path/to/tiny --batch 16 --interactive 8 --plot

One `quire serve --scheduling-policy priority` (few running slots, so a flood queues), and
two phases in the same run, on the same server: each sends `--batch` long batch requests at
once, then `--interactive` short interactive requests one every `--interval` seconds while
the batch work runs, and measures the interactive requests' time to first token (streamed).

- fcfs-equivalent: every request has priority 0 (what clients without priorities get);
- priorities: batch requests carry priority 10 (vLLM's scale: served later), interactive 0,
  so each interactive request is admitted before the queued batch work and, when KV runs
  short, preempts it.

Prints TTFT p50 / p99 of the interactive requests and the batch requests' completion time per
phase; `--plot` draws them. Figures from a shared or loaded machine mean little.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import describe_machine  # noqa: E402
from plotting import add_plot_flag, grouped_bars  # noqa: E402
from processes import free_port, stop, wait_ready  # noqa: E402

PHASES = (("no priorities", 0, 0), ("priorities", 10, 0))  # (name, batch, interactive)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def ttft(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
               priority: int) -> float:
    """Seconds to the first streamed text; the rest of the stream is read to its end."""
    start = time.perf_counter()
    first = None
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "priority": priority}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                if json.loads(line[6:])["choices"][0].get("text"):
                    first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


async def phase(url: str, args, tag: str, batch_priority: int, interactive_priority: int
                ) -> dict:
    """`tag` starts every prompt, so no phase hits the prefix cache that an earlier one left."""
    async with httpx.AsyncClient(timeout=None) as client:
        started = time.perf_counter()
        prompt = tag + " batch job {}: summarize " + "data " * args.batch_words
        batch = [asyncio.ensure_future(ttft(client, url, prompt.format(i), args.batch_tokens,
                                            batch_priority)) for i in range(args.batch)]
        await asyncio.sleep(args.interval)  # the flood is queued when the first chat comes
        chats = []
        for i in range(args.interactive):
            chats.append(asyncio.ensure_future(ttft(client, url, f"{tag} hi, question {i}?",
                                                    args.interactive_tokens,
                                                    interactive_priority)))
            await asyncio.sleep(args.interval)
        chat_ttfts = await asyncio.gather(*chats)
        await asyncio.gather(*batch)
        return {"ttft": chat_ttfts, "batch_seconds": time.perf_counter() - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the runtime's default model")
    p.add_argument("--batch", type=int, default=32, help="batch requests in the flood")
    p.add_argument("--batch-tokens", type=int, default=128)
    p.add_argument("--batch-words", type=int, default=200, help="batch prompt length (words)")
    p.add_argument("--interactive", type=int, default=16, help="interactive requests per phase")
    p.add_argument("--interactive-tokens", type=int, default=16)
    p.add_argument("--interval", type=float, default=0.5,
                   help="seconds between interactive requests")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="the server's running slots (few: the flood must queue)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--quire-args", default="", help="more `quire serve` flags")
    add_plot_flag(p, "priority")
    args = p.parse_args()
    print(describe_machine(args.num_threads))

    port = free_port()
    cmd = [sys.executable, "-m", "quire.entrypoints.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--scheduling-policy", "priority",
           "--max-num-seqs", str(args.max_num_seqs), *shlex.split(args.quire_args)]
    if args.model:
        cmd.insert(4, args.model)
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4},
                   timeout=None).raise_for_status()  # the first phase must not pay for it
        results = {}
        for name, batch_priority, chat_priority in PHASES:
            results[name] = asyncio.run(phase(url, args, name, batch_priority, chat_priority))
    finally:
        stop(proc)

    print(f"\n{args.batch} batch requests ({args.batch_tokens} tokens) flooding "
          f"{args.max_num_seqs} slots; {args.interactive} interactive requests "
          f"({args.interactive_tokens} tokens) every {args.interval:g}s\n")
    print("| phase | interactive TTFT p50 | p99 | the phase done after (every answer) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {pct(r['ttft'], 50):.3f} s | {pct(r['ttft'], 99):.3f} s | "
              f"{r['batch_seconds']:.1f} s |")
    if args.plot:
        grouped_bars(args.plot, "Interactive TTFT under a batch flood", "seconds",
                     ["TTFT p50", "TTFT p99"],
                     {name: [pct(r["ttft"], 50), pct(r["ttft"], 99)]
                      for name, r in results.items()},
                     caption=f"{args.batch} batch x {args.batch_tokens} tokens, "
                             f"{args.max_num_seqs} slots, same server, same run")


if __name__ == "__main__":
    main()
