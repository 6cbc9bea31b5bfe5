"""How long a tensor-parallel engine takes to be ready, the first time in a process and again
(an engine restarted in a notebook, a script that builds several, the test suite): its ranks
forked from Quire's fork server (quire/distributed/start_method.py) against the same ranks
spawned as fresh interpreters (multiprocessing's spawn), each in a fresh process, rounds
alternating. The model is tensor_parallel.py's random one of SmolLM2's shape (30 layers,
8 heads), float32, one thread a rank.

    python benchmarks/worker_start.py --rounds 3 --engines 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars
from tensor_parallel import smollm2_shaped_model

START_METHODS = ("forkserver", "spawn")


def engine_starts(model: str, start_method: str, engines: int) -> list[float]:
    """Seconds to a ready TP=2 engine, `engines` times in this process (shut down between)."""
    import torch

    import quire.distributed.workers as workers
    from quire import LLM
    if start_method == "spawn":  # what the ranks were started with before the fork server
        workers.worker_context = lambda: torch.multiprocessing.get_context("spawn")
    LLM(model, dtype="float32", kv_cache_memory=16 << 20).engine.shutdown()  # imports warm
    seconds = []
    for _ in range(engines):
        start = time.perf_counter()
        llm = LLM(model, dtype="float32", kv_cache_memory=16 << 20, tensor_parallel_size=2,
                  num_threads=1)
        seconds.append(time.perf_counter() - start)
        llm.engine.shutdown()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", type=int, default=3, help="engines started in each process")
    ap.add_argument("--model", help="a model whose heads divide by 2 (default: SmolLM2-shaped)")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "START_METHOD"),
                    help=argparse.SUPPRESS)
    add_plot_flag(ap, "worker_start")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(engine_starts(*args.child, args.engines)))
        return
    model = args.model or smollm2_shaped_model(tempfile.mkdtemp(prefix="quire-worker-start-"))
    print(describe_machine())
    times: dict[str, list[list[float]]] = {m: [] for m in START_METHODS}
    with StealMeter() as steal:
        for r in range(args.rounds):
            for method in START_METHODS:
                out = subprocess.run([sys.executable, __file__, "--child", model, method,
                                      "--engines", str(args.engines)], check=True,
                                     capture_output=True, text=True).stdout
                got = json.loads(out.strip().splitlines()[-1])
                times[method].append(got)
                print(f"round {r + 1} {method:>10}: " + ", ".join(f"{s:.2f}" for s in got)
                      + " s to a ready TP=2 engine", flush=True)
    print(f"during the runs: {steal}")
    medians = {}
    for method, rounds in times.items():
        first = statistics.median(r[0] for r in rounds)
        later = statistics.median(s for r in rounds for s in r[1:])
        medians[method] = [first, later]
        print(f"{method:>10}: first engine {first:.2f} s, later ones {later:.2f} s (medians)")
    if args.plot:
        grouped_bars(args.plot, "a TP=2 engine's start: seconds to ready", "seconds (median)",
                     ["first in its process", "later ones"], medians, caption=machine_caption())


if __name__ == "__main__":
    main()
