"""Soak: the server's resident set (RSS) across identical rounds of mixed requests.

Starts `quire serve` (the default model unless --model), then runs the same round twice: N
requests from C threads, a mix of completions, chat, streams, /generate, /tokenize, bad
requests, clients that disconnect mid-request and mid-stream. It prints the server's RSS
before the first round, after it, and after the second, each measured once the server has
been idle for --settle seconds (the server trims the heap when idle).

The bound: RSS after round 2 within --bound-mb of RSS after round 1 (a leak grows every round;
allocator caching does not). Exits 1 if it is not. Not a test: a benchmark that prints.

    python benchmarks/soak.py --requests 300 --concurrency 8
"""

from __future__ import annotations

import argparse
import random
import socket
import subprocess
import sys
import threading
import time

import requests
from processes import stop

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "List three colors:", "The quick brown fox"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def one_request(url: str, i: int) -> str:
    rng = random.Random(i)
    prompt = rng.choice(PROMPTS) + " " + " ".join(str(rng.randrange(1000)) for _ in range(
        rng.randrange(1, 60)))
    kind = i % 8
    try:
        if kind == 0:
            requests.post(url + "/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": 16, "logprobs": 2})
        elif kind == 1:
            requests.post(url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "n": 2,
                "temperature": 0.8, "seed": i})
        elif kind == 2:  # a stream read to the end
            with requests.post(url + "/v1/completions", stream=True, timeout=120,
                               json={"prompt": prompt, "max_tokens": 16, "stream": True,
                                     "stream_options": {"include_usage": True}}) as r:
                for _ in r.iter_lines():
                    pass
        elif kind == 3:  # a stream the client drops after a few events
            r = requests.post(url + "/v1/chat/completions", stream=True, timeout=120, json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 200,
                "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 2})
            lines = r.iter_lines()
            for _ in range(6):
                next(lines, None)
            r.close()
        elif kind == 4:  # a client that gives up before the answer
            try:
                requests.post(url + "/generate", timeout=0.3,
                              json={"prompt": prompt, "max_tokens": 200, "ignore_eos": True})
            except requests.exceptions.ReadTimeout:
                pass
        elif kind == 5:
            requests.post(url + "/tokenize", timeout=120, json={"prompt": prompt * 20})
        elif kind == 6:  # bad requests
            requests.post(url + "/v1/completions", timeout=120,
                          data=b'{"prompt": "x", "temperature": Infinity}')
            requests.post(url + "/v1/completions", timeout=120,
                          json={"prompt": "x" * 200_000})
        else:
            requests.post(url + "/generate", timeout=120,
                          json={"prompt": prompt, "max_tokens": 8})
    except requests.RequestException as e:
        return f"{type(e).__name__}"
    return ""


def run_round(url: str, n: int, concurrency: int) -> tuple[float, int]:
    it = iter(range(n))
    lock = threading.Lock()
    errors = []

    def worker():
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                return
            err = one_request(url, i)
            if err:
                errors.append(err)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, len(errors)


def idle(url: str) -> None:
    while True:
        text = requests.get(url + "/metrics", timeout=30).text
        running = [line for line in text.splitlines()
                   if line.startswith(("quire:num_requests_running", "quire:num_requests_waiting"))]
        if all(line.split()[-1] in ("0.0", "0") for line in running):
            return
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--settle", type=float, default=8.0,
                    help="seconds idle before each RSS reading (> the server's 5 s trim check)")
    ap.add_argument("--bound-mb", type=float, default=20.0)
    ap.add_argument("--server-args", default="--dtype float32 --num-threads 1 "
                    "--max-model-len 2048 --kv-cache-memory 128M",
                    help="extra `quire serve` flags")
    args = ap.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "quire.entrypoints.cli", "--log-level", "warning", "serve",
           *([args.model] if args.model else []), "--host", "127.0.0.1", "--port", str(port),
           *args.server_args.split()]
    server = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if requests.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print("the server did not start", file=sys.stderr)
                return 1
            time.sleep(0.5)
        run_round(url, 16, 4)  # warm-up: first-use allocations (kernels, caches) are not a leak
        idle(url)
        time.sleep(args.settle)
        readings = [("before", rss_mb(server.pid))]
        for r in (1, 2):
            wall, errors = run_round(url, args.requests, args.concurrency)
            idle(url)
            time.sleep(args.settle)
            readings.append((f"after round {r}", rss_mb(server.pid)))
            print(f"round {r}: {args.requests} requests in {wall:.1f}s "
                  f"({errors} client-side errors)", flush=True)
        for name, mb in readings:
            print(f"RSS {name:>14}: {mb:8.1f} MB")
        growth = readings[2][1] - readings[1][1]
        print(f"round 2 - round 1: {growth:+.1f} MB (bound {args.bound_mb:.0f} MB): "
              f"{'OK' if growth <= args.bound_mb else 'OVER'}")
        return 0 if growth <= args.bound_mb else 1
    finally:
        stop(server, timeout=60)


if __name__ == "__main__":
    sys.exit(main())
