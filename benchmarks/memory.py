"""Resident memory of a server with the default model: `quire serve` per --quantization mode,
and llama-server on the same GGUF file.

Each server starts alone; once /health answers, the script reads the resident set
(/proc/PID/status: VmRSS) after it has settled (steady, idle), sends a few short completions,
and reads VmRSS again and the peak (VmHWM) before stopping it with SIGTERM. A mode this Quire
does not have (no --quantization flag, or not among its choices) is skipped with a note.

    python benchmarks/memory.py
    python benchmarks/memory.py --modes none,int8 --skip-llama
    python benchmarks/memory.py --quick
    python benchmarks/memory.py --plot                # and plots/memory.png: RSS per server
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request

from machine import describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars
from processes import free_port, stop, wait_ready

DEFAULT_LLAMA_SERVER = "/tmp/llamabuild/bin/llama-server"


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM in bytes, of the process and (summed) its children."""
    out = {"VmRSS": 0, "VmHWM": 0}
    for p in [pid] + children(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    key = line.split(":", 1)[0]
                    if key in out:
                        out[key] += int(line.split()[1]) * 1024
        except OSError:
            pass
    return out


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in children(k)]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def complete(url: str, n: int, max_tokens: int) -> None:
    models = json.loads(get(url + "/v1/models"))["data"]
    body = {"model": models[0]["id"], "prompt": "Write a short poem about the sea.",
            "max_tokens": max_tokens, "temperature": 0}
    for _ in range(n):
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()


def measure(cmd: list[str], port: int, args) -> dict[str, int]:
    url = f"http://127.0.0.1:{port}"
    log = open(os.devnull, "w") if not args.verbose else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    try:
        wait_ready(proc, url, args.start_timeout)
        time.sleep(args.settle)
        idle = proc_status(proc.pid)["VmRSS"]
        complete(url, args.requests, args.max_tokens)
        after = proc_status(proc.pid)
        return {"idle": idle, "after": after["VmRSS"], "peak": after["VmHWM"]}
    finally:
        stop(proc)
        if log:
            log.close()


def quant_choices() -> tuple[str, ...] | None:
    """The --quantization choices this Quire offers; None if it has no such flag."""
    from quire.config import EngineArgs
    field = EngineArgs.__dataclass_fields__.get("quantization")
    if field is None:
        return None
    return tuple(field.metadata.get("choices", ())) or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="none,int8,int4,auto",
                    help="Quire --quantization modes, comma-separated")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--quire-args", default="",
                    help="more `quire serve` flags, e.g. '--kv-cache-memory 512M'")
    ap.add_argument("--requests", type=int, default=4, help="completions after the load")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds idle before reading")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="show the servers' logs")
    ap.add_argument("--quick", action="store_true", help="mode none only, one request")
    add_plot_flag(ap, "memory")
    args = ap.parse_args()
    if args.quick:
        args.modes, args.requests, args.max_tokens, args.settle = "none", 1, 8, 1.0
        args.skip_llama = True

    from quire.cpu_threads import detect_quota
    from quire.models.loader import default_model_path
    threads = args.num_threads or detect_quota().cpus
    print(describe_machine(threads))
    choices = quant_choices()
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, "-m", "quire.entrypoints.cli", "serve", "--port", "{port}",
               "--num-threads", str(threads)] + shlex.split(args.quire_args)
        label = f"quire --quantization {mode} {args.quire_args}".rstrip()
        if choices is None:
            if mode != "none":
                print(f"skipped {label}: this Quire has no --quantization flag yet")
                continue
            label = f"quire {args.quire_args} (float weights; no --quantization flag yet)"
        elif mode not in choices:
            print(f"skipped {label}: not among its choices {', '.join(choices)}")
            continue
        else:
            cmd += ["--quantization", mode]
        rows.append((label, cmd))
    if not args.skip_llama:
        if os.access(args.llama_server, os.X_OK):
            rows.append(("llama-server (-np 16 -c 16384)",
                         [args.llama_server, "-m", default_model_path(), "-t", str(threads),
                          "-np", "16", "-c", "16384", "--host", "127.0.0.1", "--port",
                          "{port}"]))
        else:
            print(f"skipped llama-server: {args.llama_server} not found "
                  "(../shared/anchors/build_llamacpp.sh builds it)")
    print("| server | RSS idle after load | RSS after requests | peak RSS (VmHWM) |")
    print("|---|---|---|---|")
    measured = {}
    for label, cmd in rows:
        port = free_port()
        cmd = [c.replace("{port}", str(port)) for c in cmd]
        try:
            r = measure(cmd, port, args)
        except (RuntimeError, OSError) as e:
            print(f"| {label} | failed: {e} | | |")
            continue
        mib = 1 << 20
        print(f"| {label} | {r['idle'] / mib:.0f} MiB | {r['after'] / mib:.0f} MiB | "
              f"{r['peak'] / mib:.0f} MiB |", flush=True)
        measured[label] = r
    if args.plot and measured:
        mib = 1 << 20
        names = [label.replace(" --quantization ", "\n") for label in measured]
        grouped_bars(args.plot, "Resident memory, default model", "MiB", names,
                     {key: [r[k] / mib for r in measured.values()]
                      for key, k in (("idle after load", "idle"), ("after requests", "after"),
                                     ("peak (VmHWM)", "peak"))},
                     caption=machine_caption(threads))


if __name__ == "__main__":
    main()
