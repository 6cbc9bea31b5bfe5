"""FP8 KV cache: how often greedy output on SmolLM2 agrees with the full-precision KV run,
and how many tokens each KV dtype holds in the same memory.

Greedy decoding of a small model is chaotic: one different token and the rest differs, so
the bfloat16-vs-float32 agreement is printed too, as the scale to read the FP8 figures on.
Agreement is reported three ways: sequences identical end to end, tokens identical before
the first divergence (the fraction of generated tokens on the common prefix), and the mean
position of the first divergence.

    python benchmarks/fp8_kv.py --num-prompts 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import random
import statistics

TOPICS = ["the ocean", "a city at night", "machine learning", "the history of Rome", "coffee",
          "a chess game", "volcanoes", "the piano", "friendship", "the moon landing",
          "bread baking", "a mountain hike", "electric cars", "honeybees", "the printing press",
          "winter in Norway"]
FORMS = ["Write a short paragraph about {}.", "Explain {} to a child.",
         "List five facts about {}.", "Tell a story that involves {}."]


def prompts(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[{"role": "user", "content": rng.choice(FORMS).format(rng.choice(TOPICS))}]
            for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from quire import LLM, SamplingParams
    chats = prompts(args.num_prompts, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs, capacity = {}, {}
    model_dtype = None
    for kv in ("auto", "fp8_e4m3", "fp8_e5m2", "float32"):
        dtype = "float32" if kv == "float32" else args.dtype
        llm = LLM(dtype=dtype, kv_cache_memory=args.kv_cache_memory,
                  kv_cache_dtype="auto" if kv == "float32" else kv)
        runs[kv] = [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]
        capacity[kv] = llm.engine.capacity_tokens
        if kv == "auto":
            model_dtype = str(llm.engine.dtype).removeprefix("torch.")
    print(f"{args.num_prompts} chat prompts, {args.max_tokens} greedy tokens each, model dtype "
          f"{model_dtype}, KV budget {args.kv_cache_memory >> 20} MiB")
    print(f"full-precision ({model_dtype}) KV: {capacity['auto']} tokens")
    for kv, ref in (("fp8_e4m3", "auto"), ("fp8_e5m2", "auto"), ("auto", "float32")):
        firsts = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
                  for r, g in zip(runs[ref], runs[kv])]
        identical = sum(f == args.max_tokens for f in firsts)
        label = (f"{kv} KV vs {model_dtype} KV" if ref == "auto"
                 else f"for scale, {model_dtype} model vs float32 model")
        print(f"{label}: {capacity[kv]} tokens ({capacity[kv] / capacity[ref]:.1f}x); "
              f"{identical}/{len(firsts)} sequences identical; "
              f"{sum(firsts) / (len(firsts) * args.max_tokens):.0%} of tokens before the first "
              f"divergence; first divergence at token {statistics.mean(firsts):.1f} on average")


if __name__ == "__main__":
    main()
