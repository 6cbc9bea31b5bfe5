"""KV capacity: concurrent sequences in a fixed KV budget, paged blocks vs a contiguous
reservation of prompt + max_tokens per request (the vLLM paper's baseline, where only
20-40% of reserved KV memory ends up holding tokens).

The paged side is measured, not computed: Quire's own Scheduler, KVCacheManager and
BlockPool run the workload (they are plain bookkeeping; a stub stands in for the model's
sampled tokens). The contiguous side admits a request only when prompt + max_tokens slots
are free, and holds them until it ends.

    python benchmarks/capacity.py --kv-tokens 65536 --max-tokens 1024
"""

from __future__ import annotations

import argparse
import random

from quire.engine.block_pool import BlockPool
from quire.engine.kv_cache_manager import KVCacheManager
from quire.engine.request import Request
from quire.engine.scheduler import Scheduler
from quire.sampling_params import SamplingParams


def simulate_paged(workload, kv_tokens: int, block_size: int, max_tokens: int):
    kv = KVCacheManager(BlockPool(kv_tokens // block_size, enable_caching=False), block_size)
    sched = Scheduler(kv, max_num_seqs=10**6, max_num_batched_tokens=8192)
    for i, (prompt, output) in enumerate(workload):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sched.add_request(Request(str(i), [5] * prompt, params, frozenset(), output))
    peak, util, steps = 0, [], 0
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {r.request_id: 5 for r, n in zip(out.requests, out.num_new_tokens)
                   if r.num_computed_tokens + n == r.num_tokens}
        sched.update(out, sampled)
        decoding = [r for r in sched.running if r.num_output_tokens > 0]
        if decoding:
            peak = max(peak, len(decoding))
            held = sum(r.num_computed_tokens for r in sched.running)
            util.append(held / max(1, kv.pool.num_used_blocks * block_size))
        steps += 1
    preemptions = sum(sched.num_preemptions.values())
    return peak, sum(util) / len(util), preemptions


def simulate_contiguous(workload, kv_tokens: int, max_tokens: int):
    """Requests admitted in order while prompt + max_tokens fits; one token per step each."""
    free, running, queue, peak, util = kv_tokens, [], list(workload), 0, []
    while queue or running:
        while queue and queue[0][0] + max_tokens <= free:
            prompt, output = queue.pop(0)
            free -= prompt + max_tokens
            running.append([prompt, output, 0])
        peak = max(peak, len(running))
        util.append(sum(p + g for p, _, g in running) / max(1, kv_tokens - free))
        for r in running:
            r[2] += 1
        for r in [r for r in running if r[2] >= r[1]]:
            running.remove(r)
            free += r[0] + max_tokens
    return peak, sum(util) / len(util)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-tokens", type=int, default=65536, help="the KV budget, in tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--prompt-len", default="32,512", help="min,max of the prompt length")
    ap.add_argument("--output-len", default="32,512", help="min,max of the actual output length")
    ap.add_argument("--max-tokens", type=int, default=1024, help="each request's max_tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    p_lo, p_hi = map(int, args.prompt_len.split(","))
    o_lo, o_hi = map(int, args.output_len.split(","))
    workload = [(rng.randint(p_lo, p_hi), rng.randint(o_lo, o_hi))
                for _ in range(args.num_requests)]
    print(f"KV budget {args.kv_tokens} tokens, block size {args.block_size}, "
          f"{args.num_requests} requests: prompts {p_lo}-{p_hi}, outputs {o_lo}-{o_hi}, "
          f"max_tokens {args.max_tokens}")
    c_peak, c_util = simulate_contiguous(workload, args.kv_tokens, args.max_tokens)
    p_peak, p_util, preempt = simulate_paged(workload, args.kv_tokens, args.block_size,
                                             args.max_tokens)
    print(f"contiguous reservation: at most {c_peak} concurrent sequences, "
          f"{c_util:.0%} of reserved KV holding tokens on average")
    print(f"paged blocks (Quire's scheduler): at most {p_peak} concurrent sequences, "
          f"{p_util:.0%} of allocated KV holding tokens on average, {preempt} preemptions")
    print(f"paged fits {p_peak / c_peak:.1f}x the sequences")


if __name__ == "__main__":
    main()
