"""How long `quire serve` takes from its command to a 200 on /ready: the pod start a scale-up
(or a scale from zero) waits for. Two cases per round, each in a fresh process:

  cold  an empty cache: a GGUF is converted first (its config, tokenizer and weights)
  warm  the same cache again: the converted folder is read

The kernels the engine builds are copied in from this machine's kernel cache first, where it
has them, so the figures are the model's start and not the C++ compiler's (a first start on a
new node also compiles, ~40 s on two cores). With `--baseline REV` the same cases run for an
older revision of the runtime (a `git archive` of it, byte-compiled, on PYTHONPATH), rounds
alternating. This checkout runs as it is: `python -m compileall runtime` first, as `make test`
does, where PYTHONDONTWRITEBYTECODE is set.

    python benchmarks/cold_start.py --rounds 3
    python benchmarks/cold_start.py --baseline 850af10 --rounds 2
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars
from processes import free_port, http_status, runtime_snapshot, stop


def seconds_to_ready(runtime: str, model: str, cache: str, timeout: float = 600.0) -> float:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=runtime, QUIRE_CACHE_DIR=cache)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "quire.entrypoints.cli", "serve", model,
                             "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/ready"
        while http_status(url) != 200:  # /health answers while the model loads; /ready not
            if proc.poll() is not None:
                raise RuntimeError(f"quire serve exited with {proc.returncode} before /ready")
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"not ready after {timeout:.0f} s")
            time.sleep(0.05)
        return time.perf_counter() - start
    finally:
        stop(proc)


def seeded_cache() -> str:
    """An empty cache but for this machine's kernel builds."""
    from quire.writable_dirs import kernel_cache_dir
    cache = tempfile.mkdtemp(prefix="quire-cold-start-")
    os.makedirs(os.path.join(cache, "kernels"))
    for built in glob.glob(os.path.join(kernel_cache_dir(), "*.so")):
        shutil.copy(built, os.path.join(cache, "kernels"))
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model (a GGUF)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="a git revision to run beside this one")
    add_plot_flag(ap, "cold_start")
    args = ap.parse_args()
    from quire.models.loader import default_model_path
    model = args.model or default_model_path()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runtimes = {"this": os.path.join(root, "runtime")}
    if args.baseline:
        runtimes[args.baseline] = runtime_snapshot(args.baseline)
    print(describe_machine())
    print(f"model: {model}")
    times: dict[tuple[str, str], list[float]] = {}
    with StealMeter() as steal:
        for r in range(args.rounds):
            for name, runtime in runtimes.items():
                cache = seeded_cache()
                try:
                    for case in ("cold", "warm"):
                        s = seconds_to_ready(runtime, model, cache)
                        times.setdefault((name, case), []).append(s)
                        print(f"round {r + 1} {name:>10} {case}: {s:.2f} s to /ready", flush=True)
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
    print(f"during the runs: {steal}")
    for case in ("cold", "warm"):
        row = [f"{case}:"]
        for name in runtimes:
            got = times[(name, case)]
            row.append(f"{name} {statistics.median(got):.2f} s (median of {len(got)}, "
                       f"{min(got):.2f}-{max(got):.2f})")
        print("  ".join(row))
    if args.plot:
        grouped_bars(args.plot, f"quire serve {os.path.basename(model)}: seconds to /ready",
                     "seconds (median)", ["cold (empty cache)", "warm"],
                     {name: [statistics.median(times[(name, case)]) for case in ("cold", "warm")]
                      for name in runtimes}, caption=machine_caption())


if __name__ == "__main__":
    main()
