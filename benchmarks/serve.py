"""Online serving benchmark: a load generator against `quire serve` (and llama-server on the
same GGUF), or against any OpenAI-compatible server.

Requests stream from /v1/completions (or /v1/chat/completions); each arrives either as soon
as one of `--concurrency` slots is free (a fixed concurrency), or at Poisson times with
`--request-rate` per second (optionally capped by --concurrency as well). Prompts are seeded
random English-like text of about --input-len words, new ones at each level; outputs are
exactly --output-len tokens (ignore_eos) unless --no-ignore-eos. Prints throughput and TTFT /
inter-token latency / end-to-end latency percentiles, plus what the server's /metrics saw
(preemptions, prefix hits).

--concurrency takes a list (a sweep). Without --url the script starts the servers itself, on
free ports with the same threads: `quire serve` with the default model and, where it is built
(../shared/anchors/build_llamacpp.sh), llama-server on the same GGUF with as many slots as the
largest concurrency; at each level the two take turns going first. --plot draws output tok/s
and TTFT / ITL p50 against concurrency, a line per server.

    python benchmarks/serve.py --plot                           # the comparison, 1..16 users
    python benchmarks/serve.py --concurrency 1,4,16 --num-prompts 32 --plot
    quire serve --port 8000 &
    python benchmarks/serve.py --url http://127.0.0.1:8000 --concurrency 8 --num-prompts 64
    python benchmarks/serve.py --url http://127.0.0.1:8000 --request-rate 4 --num-prompts 100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import httpx
from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, line_panels
from processes import free_port, stop, wait_ready

DEFAULT_LLAMA_SERVER = "/tmp/llamabuild/bin/llama-server"

WORDS = ("the of and to in is was for on that with as by at from his her an were are which "
         "this be or had not but what all when there can said who been one more time so some "
         "into them would other then these two may first water people city river mountain "
         "history science music language market engine garden winter summer north south story "
         "light paper stone letter number country morning evening family government system "
         "problem question answer").split()


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(max(1, int(rng.gauss(words, words / 4)))))
            for _ in range(n)]


async def one_request(client: httpx.AsyncClient, args, model: str, prompt: str) -> Result:
    res = Result(start=time.perf_counter())
    body = {"model": model, "max_tokens": args.output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": args.ignore_eos}
    if args.top_p < 1.0:
        body["top_p"] = args.top_p
    if args.endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    try:
        async with client.stream("POST", args.url + path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                res.end = time.perf_counter()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    res.error = event["error"].get("message", "error")
                    break
                if event.get("usage"):
                    res.prompt_tokens = event["usage"]["prompt_tokens"]
                    res.output_tokens = event["usage"]["completion_tokens"]
                for c in event.get("choices", []):
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - res.start
                        res.chunk_times.append(now)
        res.ok = not res.error
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    return res


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    try:
        text = (await client.get(url + "/metrics")).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("quire:") and " " in line:
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


async def run(args) -> dict[str, float]:
    """One load at args.url with args.concurrency; prints the report and returns its figures."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency or 0, 1) + args.num_prompts)
    async with httpx.AsyncClient(headers=headers, timeout=None, limits=limits) as client:
        model = args.model
        if model is None:
            model = (await client.get(args.url + "/v1/models")).json()["data"][0]["id"]
        prompts = make_prompts(args.num_prompts + args.warmup, args.input_len, args.level_seed)
        for p in prompts[:args.warmup]:
            await one_request(client, args, model, p)
        prompts = prompts[args.warmup:]
        before = await scrape(client, args.url)

        slots = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        rng = random.Random(args.seed + 1)

        async def limited(prompt: str) -> Result:
            if slots is None:
                return await one_request(client, args, model, prompt)
            async with slots:
                return await one_request(client, args, model, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await scrape(client, args.url)
    return report(args, model, results, duration, before, after)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def report(args, model, results: list[Result], duration: float, before, after
           ) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
    itls = [x * 1000 for r in ok for x in r.itls]
    e2e = [(r.end - r.start) * 1000 for r in ok]
    tpot = [(r.end - r.start - r.ttft) * 1000 / (r.output_tokens - 1)
            for r in ok if r.ttft is not None and r.output_tokens > 1]
    load = (f"concurrency {args.concurrency}" if args.request_rate == float("inf") else
            f"request rate {args.request_rate}/s" +
            (f", concurrency <= {args.concurrency}" if args.concurrency else ""))
    print(f"== {model} @ {args.url}, {args.endpoint}, {load}, "
          f"~{args.input_len} words in, {args.output_len} tokens out ==")
    print(f"requests            {len(ok)} ok, {len(failed)} failed in {duration:.2f} s")
    for r in failed[:3]:
        print(f"  failure: {r.error}")
    print(f"request throughput  {len(ok) / duration:.2f} req/s")
    print(f"output throughput   {out_tokens / duration:.1f} tok/s")
    print(f"total throughput    {(in_tokens + out_tokens) / duration:.1f} tok/s "
          f"({in_tokens} prompt + {out_tokens} generated tokens)")
    for name, values in (("TTFT", ttfts), ("ITL", itls), ("TPOT", tpot), ("E2E", e2e)):
        mean = statistics.fmean(values) if values else float("nan")
        print(f"{name:<5} ms  mean {mean:8.1f}  p50 {pct(values, 50):8.1f}  "
              f"p90 {pct(values, 90):8.1f}  p99 {pct(values, 99):8.1f}")
    if before and after:
        def delta(k):
            return after.get(k, 0.0) - before.get(k, 0.0)
        print(f"server: {delta('quire:num_preemptions_total'):.0f} preemptions, prefix cache "
              f"hits {delta('quire:prefix_cache_hits_total'):.0f} / "
              f"{delta('quire:prefix_cache_queries_total'):.0f} queried tokens")
    return {"output tok/s": out_tokens / duration, "failed": len(failed),
            "TTFT p50 ms": pct(ttfts, 50), "TTFT p99 ms": pct(ttfts, 99),
            "ITL p50 ms": pct(itls, 50), "ITL p99 ms": pct(itls, 99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None,
                   help="a running server; default: start quire serve (and llama-server)")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--api-key", default=os.environ.get("QUIRE_API_KEY"))
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", default=None,
                   help="requests in flight at most, or a comma-separated sweep (default "
                        "1,2,4,8,16 when the script starts the servers)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--input-len", type=int, default=64, help="prompt length in words (mean)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (one at a time) first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None,
                   help="threads for the servers this script starts (default: the CPU quota)")
    p.add_argument("--quire-args", default="", help="more `quire serve` flags")
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER, metavar="PATH")
    p.add_argument("--skip-llama", action="store_true")
    add_plot_flag(p, "serve")
    args = p.parse_args()
    if args.concurrency is None and args.url is None:
        args.concurrency = "1,2,4,8,16"
    if args.concurrency is None and args.request_rate == float("inf"):
        p.error("give --concurrency or --request-rate (or both)")
    try:
        levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else [None]
    except ValueError:
        p.error(f"--concurrency: integers, comma-separated, not {args.concurrency!r}")
    if args.url:
        sweep(args, levels, {"server": args.url})
        return
    with launched_servers(args, max(c or 1 for c in levels)) as urls:
        sweep(args, levels, urls)


def sweep(args, levels: list[int | None], urls: dict[str, str]) -> None:
    """Each level on each server, the servers taking turns going first; a table, a plot."""
    figures: dict[str, dict[int, dict[str, float]]] = {name: {} for name in urls}
    for i, level in enumerate(levels):
        names = list(urls) if i % 2 == 0 else list(reversed(urls))
        # each level its own prompts (the servers at one level the same ones): with one set
        # for all, every level after the first found the earlier levels' prompts in the
        # servers' prefix caches (Quire's c = 32 after c = 8: 3,392 of 3,917 tokens hit)
        args.level_seed = args.seed + 7919 * i
        for name in names:
            args.url, args.concurrency = urls[name], level
            with StealMeter() as steal:
                figures[name][level] = asyncio.run(run(args))
            print(f"({name}, {steal})\n", flush=True)
    print("| server | concurrency | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
    print("|---|---|---|---|---|")
    for name, rows in figures.items():
        for level, f in rows.items():
            print(f"| {name} | {level} | {f['output tok/s']:.1f} | {f['TTFT p50 ms']:.0f} / "
                  f"{f['TTFT p99 ms']:.0f} | {f['ITL p50 ms']:.1f} / {f['ITL p99 ms']:.1f} |")
    if args.plot and None not in levels:
        def series(key):
            return {name: (list(rows), [f[key] for f in rows.values()])
                    for name, rows in figures.items()}
        line_panels(args.plot, f"Serving: ~{args.input_len} words in, {args.output_len} tokens "
                    f"out, {args.num_prompts} requests per level", "concurrent requests",
                    [("output tok/s", series("output tok/s")), ("TTFT p50 (ms)",
                     series("TTFT p50 ms")), ("ITL p50 (ms)", series("ITL p50 ms"))],
                    caption=machine_caption(args.num_threads), log_x=True)


@contextlib.contextmanager
def launched_servers(args, slots: int):
    """quire serve and (if built) llama-server on the default GGUF, ready; stopped after."""
    import sys

    from quire.cpu_threads import detect_quota
    from quire.models.loader import default_model_path
    args.num_threads = threads = args.num_threads or detect_quota().cpus
    print(describe_machine(threads))
    commands = {"Quire": [sys.executable, "-m", "quire.entrypoints.cli", "serve", "--host",
                          "127.0.0.1", "--port", "{port}", "--num-threads", str(threads)]
                + shlex.split(args.quire_args)}
    if not args.skip_llama:
        if os.access(args.llama_server, os.X_OK):
            # -c is split between the slots: each gets 1,024 tokens, enough for one request
            commands[f"llama-server -np {slots}"] = [
                args.llama_server, "-m", default_model_path(), "-t", str(threads), "-np",
                str(slots), "-c", str(1024 * slots), "--host", "127.0.0.1", "--port", "{port}"]
        else:
            print(f"llama-server not found at {args.llama_server} "
                  "(../shared/anchors/build_llamacpp.sh builds it): Quire only")
    procs, urls = [], {}
    try:
        for name, cmd in commands.items():
            port = free_port()
            procs.append(subprocess.Popen([c.replace("{port}", str(port)) for c in cmd],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            urls[name] = f"http://127.0.0.1:{port}"
            wait_ready(procs[-1], urls[name])
        yield urls
    finally:
        for proc in procs:
            stop(proc)

if __name__ == "__main__":
    main()
