"""KV tiers: the time to first token of a long shared prefix after the KV pool evicted it,
served from the pool (not evicted, for reference), the host-RAM tier, the disk tier, a Redis
server, or recomputed; then a multi-turn chat workload's prefix hit rate and throughput with
and without the host tier, beside each other. The goal: a host-tier hit at least 5x faster
than recomputing the prefix on this CPU.

Each mode gets its own engine with a pool that holds the prefix about once and a half, so one
filler prompt evicts it. The remote mode needs --redis-url, or a `redis-server` on PATH (it
is started on a free port and stopped).

    python benchmarks/kv_tiering.py                       # SmolLM2, a 4,096-token prefix
    python benchmarks/kv_tiering.py --quick               # 512 tokens, a short chat run
    python benchmarks/kv_tiering.py --plot                # and plots/kv_tiering.png
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import subprocess
import tempfile
import time

from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars

MODES = ("pool", "host", "disk", "remote", "recompute")


_block_bytes: dict[tuple, int] = {}


def block_bytes(args) -> int:
    """One KV block's bytes for this model and dtype (a throwaway engine tells, once)."""
    from quire import LLM
    key = (args.model, args.dtype)
    if key not in _block_bytes:
        probe = LLM(args.model, dtype=args.dtype, kv_cache_memory=64 << 20)
        _block_bytes[key] = probe.engine.executor.kv_cache.block_nbytes
        del probe
    return _block_bytes[key]


def make_llm(args, mode: str, pool_tokens: int, tmp: str, redis_url: str | None):
    """An engine whose pool holds `pool_tokens`, with the mode's tier."""
    from quire import LLM
    kw = {"num_threads": args.num_threads} if args.num_threads else {}
    if mode == "host":
        kw["kv_offloading_size"] = args.tier_gib
    elif mode == "disk":
        kw.update(kv_offloading_disk_path=f"{tmp}/disk", kv_offloading_disk_size=args.tier_gib)
    elif mode == "remote":
        kw["kv_offloading_remote"] = redis_url
    blocks = -(-pool_tokens // 16)
    return LLM(args.model, dtype=args.dtype, kv_cache_memory=blocks * block_bytes(args), **kw)


def ttft(llm, prompt) -> tuple[float, int]:
    from quire import SamplingParams
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - t0, out.num_cached_tokens


def prefix_ttft(args, mode: str, tmp: str, redis_url: str | None) -> dict:
    from quire import SamplingParams
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_len)]
    pool_tokens = int(args.prefix_len * 1.5) + 64
    llm = make_llm(args, mode, pool_tokens, tmp, redis_url)
    ttft(llm, [5, 6, 7])  # warm-up
    cold, _ = ttft(llm, prefix)
    if mode != "pool":  # one filler that needs the whole pool evicts the prefix
        filler = [rng.randrange(100, 40000) for _ in range(pool_tokens - 32)]
        llm.generate([filler], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        if llm.engine.kv_tiers is not None:
            llm.engine.kv_tiers.flush()
    again, cached = ttft(llm, prefix)
    llm.engine.shutdown()
    print(f"{mode:>9}: cold {cold:.3f} s, after eviction {again:.3f} s "
          f"({cached} of {len(prefix)} tokens cached)")
    return {"cold": cold, "ttft": again, "cached": cached}


def multi_turn(args, tiered: bool, tmp: str) -> dict:
    """Conversations take turns; each turn resends its whole history plus a new question.
    The pool holds about one conversation, so the others' prefixes are evicted between
    their turns."""
    from quire import SamplingParams
    rng = random.Random(1)
    system = [rng.randrange(100, 40000) for _ in range(args.chat_system_len)]
    histories = [list(system) for _ in range(args.chats)]
    pool_tokens = args.chat_system_len + args.turns * (args.question_len + args.reply_len) + 64
    llm = make_llm(args, "host" if tiered else "recompute", pool_tokens, tmp, None)
    params = SamplingParams(temperature=0, max_tokens=args.reply_len, ignore_eos=True)
    tokens = queries = hits = 0
    start = time.perf_counter()
    for _ in range(args.turns):
        for h in histories:
            h += [rng.randrange(100, 40000) for _ in range(args.question_len)]
            out = llm.generate([h], params, use_tqdm=False)[0]
            queries += len(h)
            hits += out.num_cached_tokens
            tokens += len(h) + len(out.outputs[0].token_ids)
            h += out.outputs[0].token_ids
    wall = time.perf_counter() - start
    llm.engine.shutdown()
    result = {"hit_rate": hits / queries, "tok_s": tokens / wall, "wall": wall}
    print(f"multi-turn {'host tier' if tiered else 'pool only'}: prefix hit rate "
          f"{result['hit_rate']:.1%}, {result['tok_s']:.0f} tok/s (prompt + generated), "
          f"{wall:.1f} s")
    return result


def start_redis(binary: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    import redis
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M (the runtime's default)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--tier-gib", type=float, default=2.0, help="each tier's size")
    ap.add_argument("--redis-url", default=None, help="default: start redis-server if on PATH")
    ap.add_argument("--chats", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--chat-system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=48)
    ap.add_argument("--reply-len", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="a 512-token prefix, 3 chats x 2 turns")
    add_plot_flag(ap, "kv_tiering")
    args = ap.parse_args()
    print(describe_machine(args.num_threads))
    if args.quick:
        args.prefix_len, args.chats, args.turns, args.chat_system_len = 512, 3, 2, 128
        args.reply_len, args.tier_gib = 8, 0.5
    redis_proc, redis_url = None, args.redis_url
    if redis_url is None and shutil.which("redis-server"):
        redis_proc, redis_url = start_redis(shutil.which("redis-server"))
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp, StealMeter() as steal:
            for mode in MODES:
                if mode == "remote" and redis_url is None:
                    print("   remote: skipped (no --redis-url and no redis-server on PATH)")
                    continue
                results[mode] = prefix_ttft(args, mode, tmp, redis_url)
            chats = {name: multi_turn(args, tiered, tmp)
                     for name, tiered in (("pool only", False), ("host tier", True))}
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
    speedup = results["recompute"]["ttft"] / results["host"]["ttft"]
    print(f"host-tier hit vs recompute: {speedup:.1f}x faster (goal: >= 5x); {steal}")
    if args.plot:
        modes = list(results)
        caption = machine_caption(args.num_threads) + f"; {steal}"
        grouped_bars(args.plot, f"TTFT of a {args.prefix_len}-token prefix after eviction",
                     "seconds", modes, {"TTFT": [results[m]["ttft"] for m in modes]},
                     caption=caption)
        grouped_bars(args.plot.replace(".png", "_chat.png"),
                     f"{args.chats} chats x {args.turns} turns", "value",
                     ["prefix hit rate (%)", "throughput (tok/s)"],
                     {name: [100 * r["hit_rate"], r["tok_s"]] for name, r in chats.items()},
                     caption=caption)


if __name__ == "__main__":
    main()
