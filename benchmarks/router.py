"""Router benchmark: round-robin vs prefix-aware routing over local `quire serve` replicas.

Starts `--replicas` replicas (default 3, the default model unless --model) on 127.0.0.41..,
then for each policy a `quire router` on 127.0.0.40 in front of them, and plays `--users`
multi-turn chats at once: each user's turn sends the whole conversation so far (its own system
prompt, earlier questions and answers) plus a new question, so every turn extends the last.
Prints TTFT p50 / p99 / mean and the replicas' prefix-cache hit rate (hit tokens / looked-up
prompt tokens, from their /metrics) per policy, and the ratio of mean TTFTs. Replicas are
started afresh for each policy, so neither run inherits the other's cache.

    python benchmarks/router.py                                  # 32 users x 4 turns
    python benchmarks/router.py --users 8 --turns 3 --max-tokens 8   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import StealMeter  # noqa: E402
from processes import stop  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her an were are which "
         "this be or had not but what all when there can said who been one more time so some "
         "into them would other then these two may first water people city river mountain "
         "history science music language market engine garden winter summer north south story "
         "light paper stone letter number country morning evening family government system "
         "problem question answer").split()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Child:
    """A child process serving HTTP; stopped by PID."""

    def __init__(self, name: str, cmd: list[str], host: str, port: int, ready: str) -> None:
        self.name, self.url, self.ready = name, f"http://{host}:{port}", ready
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{name}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + self.ready, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.log.flush()
        with open(self.log.name) as f:
            tail = "".join(f.readlines()[-30:])
        raise RuntimeError(f"{self.name} not ready:\n{tail}")

    def stop(self) -> None:
        stop(self.proc)
        self.log.close()
        os.unlink(self.log.name)


def start_replicas(args) -> list[Child]:
    replicas = []
    for i in range(args.replicas):
        host = f"127.0.0.{41 + i}"
        port = free_port(host)
        cmd = [sys.executable, "-m", "quire.entrypoints.cli", "serve",
               *([args.model] if args.model else []), "--host", host, "--port", str(port),
               "--num-threads", str(args.threads), "--kv-cache-memory", args.kv_cache_memory,
               "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size)]
        replicas.append(Child(f"replica{i}", cmd, host, port, "/ready"))
    for r in replicas:
        r.wait_ready(600)
    return replicas


def start_router(args, routing: str, replicas: list[Child]) -> Child:
    host = "127.0.0.40"
    port = free_port(host)
    cmd = [sys.executable, "-m", "quire.router", "--host", host, "--port", str(port),
           "--routing", routing, "--block-size", str(args.block_size),
           "--scrape-interval", "0.5", *(f"--backend={r.url}" for r in replicas)]
    if args.model:
        cmd += ["--model", args.model]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    router = Child(f"router-{routing}", cmd, host, port, "/health")
    router.wait_ready(300)
    return router


def sample_sum(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


def prefix_counters(replicas: list[Child]) -> tuple[float, float]:
    """(prefix-cache hit tokens, looked-up prompt tokens), summed over the replicas."""
    return (sum(sample_sum(r.url, "quire:prefix_cache_hits_total") for r in replicas),
            sum(sample_sum(r.url, "quire:prefix_cache_queries_total") for r in replicas))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def one_user(client: httpx.AsyncClient, url: str, args, user: int, seed: int,
                   ttfts: list[tuple[int, float, float]], errors: list[str]) -> None:
    """Appends (turn, TTFT, end-to-end latency) per answered turn."""
    rng = random.Random(seed * 1000 + user)
    messages = [{"role": "system", "content": f"You are assistant {user}. "
                                              + words(rng, args.system_words)}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": words(rng, args.turn_words)})
        body = {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        start = time.perf_counter()
        first = None
        text = []
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        errors.append(str(event["error"]))
                        return
                    delta = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
                    if delta:
                        if first is None:
                            first = time.perf_counter() - start
                        text.append(delta)
        except httpx.HTTPError as e:
            errors.append(f"{type(e).__name__}: {e}")
            return
        if first is not None:
            ttfts.append((turn, first, time.perf_counter() - start))
        messages.append({"role": "assistant", "content": "".join(text)})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def play(url: str, args, seed: int) -> tuple[list[tuple], list[str], float]:
    ttfts: list[tuple] = []
    errors: list[str] = []
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None)) as client:
        await asyncio.gather(*(one_user(client, url, args, u, seed, ttfts, errors)
                               for u in range(args.users)))
    return ttfts, errors, time.perf_counter() - start


def run_policy(args, routing: str) -> dict:
    replicas = start_replicas(args)
    router = None
    try:
        router = start_router(args, routing, replicas)
        hits0, queries0 = prefix_counters(replicas)
        done0 = [sample_sum(r.url, "quire:request_success_total") for r in replicas]
        with StealMeter() as steal:
            results, errors, wall = asyncio.run(play(router.url, args, args.seed))
        hits, queries = prefix_counters(replicas)
        hit_rate = (hits - hits0) / max(1.0, queries - queries0)
        per_replica = [int(sample_sum(r.url, "quire:request_success_total") - d)
                       for r, d in zip(replicas, done0)]
        ttfts = [t for _, t, _ in results] or [float("nan")]
        later = [t for turn, t, _ in results if turn > 0] or [float("nan")]
        return {"routing": routing, "requests": len(results), "errors": errors, "wall": wall,
                "p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99),
                "mean": statistics.fmean(ttfts), "mean_later": statistics.fmean(later),
                "e2e": statistics.fmean([e for _, _, e in results] or [float("nan")]),
                "hit_rate": hit_rate, "per_replica": per_replica, "steal": str(steal)}
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the runtime's default model")
    p.add_argument("--tokenizer", default=None, help="for the router (default: the model's)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--turn-words", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--kv-cache-memory", default="256M")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="round-robin,prefix-aware")
    args = p.parse_args()
    results = [run_policy(args, routing) for routing in args.policies.split(",")]
    print(f"\n{args.replicas} replicas, {args.users} users x {args.turns} turns, "
          f"{args.max_tokens} output tokens per turn")
    print(f"{'routing':<14} {'requests':>8} {'errors':>6} {'TTFT p50':>9} {'p99':>8} "
          f"{'mean':>8} {'turns 2+':>9} {'e2e':>8} {'hit rate':>9} {'wall':>7}  "
          f"per replica  steal")
    for r in results:
        print(f"{r['routing']:<14} {r['requests']:>8} {len(r['errors']):>6} {r['p50']:>8.2f}s "
              f"{r['p99']:>7.2f}s {r['mean']:>7.2f}s {r['mean_later']:>8.2f}s {r['e2e']:>7.2f}s "
              f"{r['hit_rate']:>8.1%} {r['wall']:>6.1f}s  {r['per_replica']}  {r['steal']}")
        for e in r["errors"][:3]:
            print(f"    error: {e}")
    by = {r["routing"]: r for r in results}
    if "round-robin" in by and "prefix-aware" in by:
        rr, pa = by["round-robin"], by["prefix-aware"]
        print(f"mean TTFT round-robin / prefix-aware = {rr['mean'] / pa['mean']:.2f}x "
              f"(turns 2+: {rr['mean_later'] / pa['mean_later']:.2f}x; end-to-end "
              f"{rr['e2e'] / pa['e2e']:.2f}x; wall {rr['wall'] / pa['wall']:.2f}x)")


if __name__ == "__main__":
    main()
