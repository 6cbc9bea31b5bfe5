"""The mean-TTFT ratio prefix_cache.py should show, from FLOP counts alone.

Replays prefix_cache.py's workload (64 requests, a shared 1,024-token prompt, 64-token
questions, 32 outputs, all at once) through Quire's scheduling rules (one token budget per
step; running decodes first, then prefill chunks first come first served; a cached prefix is
skipped once its blocks are computed) and charges every step its FLOPs: the linear layers
(2 x weights x tokens, the LM head for the rows that sample) plus attention (4 x heads x
head_dim x context x layers per query token) times `attention cost`, the price of an
attention FLOP relative to a matmul FLOP. A request's TTFT is the cost up to the end of the
step that finishes its prompt. Both sides run at the same rates, so the rates cancel and the
ratio depends only on the workload, the model's shape and that relative price:

- attention cost 0: attention free, the ratio is the linear layers' work alone;
- attention cost 1: an attention FLOP costs a matmul FLOP (both at the FMA ceiling);
- above 1: attention runs below the matmuls' rate (a bfloat16/AMX matmul beside float32
  attention, or a slow attention kernel).

An expectation, not a ceiling: costs that are not FLOPs (norms, the KV write, step overheads)
differ per token between the sides, and real runs scatter around it (benchmarks/README).

    python benchmarks/prefix_cache_bound.py
    python benchmarks/prefix_cache_bound.py --attention-cost 0 1 1.2 2
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from prefix_cache import add_workload_args

# SmolLM2-135M-Instruct, the default model
SMOLLM2 = dict(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
               vocab=49152)


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def layer_weights(self) -> int:  # q, k, v, o, gate, up, down of all layers
        qkvo = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (qkvo + 3 * self.hidden * self.intermediate)

    def attention_flops(self, context: int) -> int:  # one query token over `context` keys
        return 4 * self.heads * self.head_dim * context * self.layers


@dataclass(eq=False)  # each request is itself: `in` and `remove` must not match look-alikes
class Seq:
    prompt: int     # prompt tokens
    computed: int   # prompt tokens computed or found cached
    outputs: int = 0
    ttft: float | None = None


def simulate(shape: Shape, n: int, prefix: int, question: int, max_tokens: int, budget: int,
             caching: bool, attention_cost: float, block: int = 16,
             prefill_first: bool = False) -> list[float]:
    """Each request's TTFT, in matmul-FLOP units. prefill_first: decodes wait while any
    prompt is unfinished (vLLM v0's policy; Quire, like vLLM v1, serves decodes first)."""
    seqs = [Seq(prefix + question, 0) for _ in range(n)]
    waiting = list(seqs)
    running: list[Seq] = []
    cached = 0  # prefix tokens in full, computed blocks
    now = 0.0
    while waiting or running:
        left, cost, sampled, done, decoded = budget, 0.0, 0, [], []
        hold = prefill_first and any(s.computed < s.prompt for s in running + waiting)
        for s in running:
            if s.computed == s.prompt and not hold:  # one token at context prompt + outputs
                decoded.append(s)
                left -= 1
                cost += shape.attention_flops(s.prompt + s.outputs) * attention_cost
                sampled += 1
        for s in list(running) + waiting:  # prefill chunks, oldest first
            if left == 0:
                break
            if s.computed == s.prompt:
                continue
            if s not in running:
                if caching:
                    s.computed = max(s.computed, min(cached, (s.prompt - 1) // block * block))
                running.append(s)
                waiting.remove(s)
            take = min(left, s.prompt - s.computed)
            # tokens computed + 1 .. computed + take attend to that many keys each
            keys = take * (2 * s.computed + take + 1) // 2
            cost += shape.attention_flops(keys) * attention_cost
            s.computed += take
            left -= take
            if s.computed == s.prompt:
                sampled += 1
                done.append(s)
        tokens = budget - left
        cost += 2 * shape.layer_weights * tokens + 2 * shape.hidden * shape.vocab * sampled
        now += cost
        if caching:  # the first request's prefix blocks, once computed, serve the others
            cached = max(cached, min(prefix // block * block,
                                     max((s.computed for s in running), default=0)))
        for s in decoded:
            s.outputs += 1
        for s in done:
            s.ttft, s.outputs = now, 1
        running = [s for s in running if s.outputs < max_tokens]
    return [s.ttft for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="the step budget (the CPU default on 2 threads: 512)")
    ap.add_argument("--attention-cost", type=float, nargs="+", default=[0.0, 1.0, 1.2, 2.0])
    ap.add_argument("--prefill-first", action="store_true",
                    help="model decodes waiting for every prompt (not Quire's policy)")
    ap.add_argument("--target", type=float, default=10.0, help="the ratio to solve for")
    args = ap.parse_args()
    shape = Shape(**SMOLLM2)

    def mean_ttfts(attention_cost: float) -> tuple[float, float]:
        """(caching on, caching off), in FLOPs."""
        return tuple(statistics.mean(simulate(
            shape, args.num_requests, args.prefix_len, args.question_len, args.max_tokens,
            args.max_num_batched_tokens, caching, attention_cost,
            prefill_first=args.prefill_first)) for caching in (True, False))

    print(f"{args.num_requests} requests, {args.prefix_len}-token shared prefix, "
          f"{args.question_len}-token questions, {args.max_tokens} outputs, budget "
          f"{args.max_num_batched_tokens}; SmolLM2-135M's shape")
    print("| attention cost | mean TTFT on (GFLOP) | off (GFLOP) | off / on |")
    print("|---|---|---|---|")
    for a in args.attention_cost:
        on, off = mean_ttfts(a)
        print(f"| {a:g} | {on / 1e9:.0f} | {off / 1e9:.0f} | {off / on:.2f}x |")

    def ratio(a: float) -> float:
        on, off = mean_ttfts(a)
        return off / on

    lo, hi = 0.0, 4.0  # the ratio falls as attention gets dearer
    if ratio(lo) < args.target:
        print(f"{args.target:g}x is beyond this workload even with free attention")
        return
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) >= args.target else (lo, mid)
    print(f"{args.target:g}x needs an attention FLOP to cost at most {lo:.2f} of a matmul FLOP")


if __name__ == "__main__":
    main()
