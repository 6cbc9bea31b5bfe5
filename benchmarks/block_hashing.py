"""Prefix-cache block hashing: SHA-256 (quire.engine.block_hash) against the built-in hash()
of int tuples it replaced, in one run. Prints ns per token of hashing alone for each, then
offline throughput with prefix caching on, the engine hashing one way and then the other.

The old hashing is put back for the comparison by swapping the KV-cache manager's hash
function for a copy of the old one (this script's private switch; the engine has none).

    python benchmarks/block_hashing.py
    python benchmarks/block_hashing.py --block-size 16 --num-requests 32 --prefix-len 512
    python benchmarks/block_hashing.py --skip-engine          # hashing alone
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from contextlib import contextmanager

from machine import StealMeter, describe_machine


# --- the hash functions ---------------------------------------------------------------------
def builtin_extend_block_hashes(hashes, token_ids, block_size, num_full_blocks, keys=None):
    """The hashing before SHA-256: hash((parent, tuple(block))), the keys' tuple as the seed."""
    parent = hashes[-1] if hashes else (None if keys is None else hash(keys))
    for i in range(len(hashes), num_full_blocks):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)


def ns_per_token(extend, tokens: list[int], block_size: int, repeats: int) -> float:
    """The best of `repeats` passes that hash the whole stream, block by block, as the
    KV-cache manager does when blocks fill."""
    n = len(tokens) // block_size
    best = float("inf")
    for _ in range(repeats):
        hashes: list = []
        start = time.perf_counter_ns()
        extend(hashes, tokens, block_size, n)
        best = min(best, time.perf_counter_ns() - start)
    return best / (n * block_size)


@contextmanager
def engine_hashing(kind: str):
    """The KV-cache manager hashing with SHA-256 ('sha256', as shipped) or the old way."""
    from quire.engine import kv_cache_manager
    shipped = kv_cache_manager.extend_block_hashes
    if kind == "builtin":
        kv_cache_manager.extend_block_hashes = builtin_extend_block_hashes
    try:
        yield
    finally:
        kv_cache_manager.extend_block_hashes = shipped


# --- offline throughput with prefix caching ---------------------------------------------------
def run_engine(prompts, kind: str, args) -> float:
    from quire import LLM, SamplingParams
    kw = {"num_threads": args.num_threads} if args.num_threads else {}
    llm = LLM(dtype=args.dtype, enable_prefix_caching=True, block_size=args.block_size, **kw)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with engine_hashing(kind):
        llm.generate([[7, 8, 9]], params, use_tqdm=False)  # warm-up (not sharing the prefix)
        start = time.perf_counter()
        with StealMeter() as steal:
            outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    total = generated + sum(map(len, prompts))
    cached = sum(o.num_cached_tokens for o in outs)
    print(f"engine, {kind:>7} hashing: {len(prompts)} requests in {wall:.2f} s, "
          f"{generated / wall:.1f} generated tok/s, {total / wall:.1f} total tok/s, "
          f"{cached} prompt tokens cached, {steal}")
    return total / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hash-tokens", type=int, default=1 << 18,
                    help="tokens hashed per pass in the hashing-alone figure")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(describe_machine(args.num_threads))

    from quire.engine.block_hash import extend_block_hashes
    rng = random.Random(0)
    tokens = [rng.randrange(0, 152_000) for _ in range(args.hash_tokens)]
    with StealMeter() as steal:
        old = ns_per_token(builtin_extend_block_hashes, tokens, args.block_size, args.repeats)
        new = ns_per_token(extend_block_hashes, tokens, args.block_size, args.repeats)
    print(f"hashing alone, block size {args.block_size}: builtin hash() {old:.1f} ns/token, "
          f"SHA-256 {new:.1f} ns/token ({new - old:+.1f} ns/token, {new / old:.1f}x), {steal}")
    if args.skip_engine:
        return

    system = [rng.randrange(3, 49152) for _ in range(args.prefix_len)]
    prompts = [system + [rng.randrange(3, 49152) for _ in range(args.question_len)]
               for _ in range(args.num_requests)]
    totals: dict[str, list[float]] = {"sha256": [], "builtin": []}
    for rnd in range(args.rounds):  # alternating which goes first: neither gets the quiet slot
        for kind in (("sha256", "builtin") if rnd % 2 == 0 else ("builtin", "sha256")):
            totals[kind].append(run_engine(prompts, kind, args))
    new, old = (statistics.median(totals[k]) for k in ("sha256", "builtin"))
    print(f"median of {args.rounds} rounds: sha256 {new:.1f} total tok/s, builtin {old:.1f} "
          f"({100 * (new / old - 1):+.1f}%)")


if __name__ == "__main__":
    main()
