"""What a JSON schema costs: output tok/s with and without one, at batch 1 and 32, on the
default model (SmolLM2-135M-Instruct).

Both runs generate exactly the same number of tokens: the schema asks for an array of at least
500 small objects, so no request's grammar ends before max_tokens, and the free run uses
ignore_eos. The difference is the grammar's whole cost: compiling (warm-up excluded: the
compiled-grammar cache holds it), filling one mask per row per step, applying the batch's
masks, and advancing the matchers. Sampling is on (temperature 0.8, seeded).

    python benchmarks/structured.py                        # batch 1 and 32, 128 tokens
    python benchmarks/structured.py --max-tokens 8 --batch-sizes 1 4   # a quick check
"""

from __future__ import annotations

import argparse
import statistics
import time

from machine import StealMeter

SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 500, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"type": "string", "maxLength": 16}},
        "required": ["name", "age", "city"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}
QUESTION = "List people you know, with their names, ages and home cities, as JSON."


def run(llm, batch: int, max_tokens: int, guided) -> tuple[float, int, list[float]]:
    from quire import SamplingParams
    prompt = {"prompt_token_ids": llm.apply_chat_template(
        [{"role": "user", "content": QUESTION}])}
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens,
                             ignore_eos=guided is None, guided_decoding=guided)
              for i in range(batch)]
    llm.engine.drain_events()
    start = time.perf_counter()
    outs = llm.generate([prompt] * batch, params, use_tqdm=False)
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == batch * max_tokens, "a request ended early: the comparison is unfair"
    return wall, generated, llm.engine.drain_events().grammar_mask_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()

    from quire import LLM
    from quire.structured import GuidedDecodingParams
    kw = {k: v for k, v in (("dtype", args.dtype), ("num_threads", args.num_threads),
                            ("max_num_seqs", max(args.batch_sizes))) if v is not None}
    llm = LLM(**kw)
    guided = GuidedDecodingParams(json=SCHEMA)
    run(llm, 2, 4, None)    # warm-up: kernels,
    run(llm, 2, 4, guided)  # and the grammar compiled and cached
    print(f"SmolLM2 {str(llm.engine.dtype).removeprefix('torch.')}, {args.max_tokens} output "
          f"tokens per request, sampling")
    for batch in args.batch_sizes:
        with StealMeter() as steal:
            free_wall, n, _ = run(llm, batch, args.max_tokens, None)
            json_wall, _, mask = run(llm, batch, args.max_tokens, guided)
        free, with_json = n / free_wall, n / json_wall
        mask_ms = statistics.mean(mask) * 1e3 if mask else 0.0
        print(f"batch {batch:3d}: free {free:7.1f} tok/s | JSON schema {with_json:7.1f} tok/s "
              f"({100 * (with_json / free - 1):+.1f}%) | mask fill {mask_ms:.2f} ms/step "
              f"({1e3 * sum(mask) / n:.3f} ms/token) | {steal}")


if __name__ == "__main__":
    main()
