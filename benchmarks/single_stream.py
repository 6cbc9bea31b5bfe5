"""Single-stream speed: one request at a time, as one user on their own box sees it.

Decode: a 128-token random prompt, 256 generated tokens, greedy, ignore_eos; decode tok/s is
(tokens after the first) / (time after the first), and p50/p90 inter-token latency come from
the engine's own steps (one token per step at batch 1). Prefill: a fresh 512-token prompt,
one output token; prefill tok/s is 512 / time to the first token. Best of --repeats for
prefill, median run for decode. Default model: the SmolLM2-135M-Instruct GGUF.

    python benchmarks/single_stream.py
    python benchmarks/single_stream.py --quantization int4 --num-threads 2
    python benchmarks/single_stream.py --quick
    python benchmarks/single_stream.py --plot   # and plots/single_stream.png: ITL per token
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import time

from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, line_panels


@dataclasses.dataclass
class SingleStream:
    prefill_tok_s: float   # 512-token prompt / time to first token (best of the repeats)
    decode_tok_s: float    # median run
    itl_p50_ms: float
    itl_p90_ms: float
    threads: int
    engine_note: str
    itl_ms: list[float] = dataclasses.field(default_factory=list)  # the median run, in order


def engine_kwargs(args) -> tuple[dict, str]:
    """LLM(...) keywords from the flags; --quantization only where EngineArgs has it."""
    from quire.config import EngineArgs
    kw = {"model": args.model, "dtype": args.dtype, "num_threads": args.num_threads}
    note = ""
    if args.quantization is not None:
        if "quantization" in EngineArgs.field_names():
            kw["quantization"] = args.quantization
        else:
            note = (f"--quantization {args.quantization} ignored: this Quire has no "
                    f"quantization option yet (float weights)")
    if getattr(args, "activation_quantization", None) is not None:
        kw["activation_quantization"] = args.activation_quantization
    return {k: v for k, v in kw.items() if v is not None}, note


def random_prompt(rng: random.Random, n: int, vocab: int = 49152) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def step_times(engine, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds from submission to each generated token (one token per step at batch 1)."""
    from quire import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(None, prompt, params)
    stamps = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            new = len(o.outputs[0].token_ids) - len(stamps)
            stamps += [now - start] * new
    assert len(stamps) == max_tokens, (len(stamps), max_tokens)
    return stamps


_runs = itertools.count()  # a fresh seed per call: never a prefix-cache hit on an earlier prompt


def measure(llm, prompt_len: int, decode_tokens: int, prefill_len: int, repeats: int
            ) -> tuple[float, float, float, float, list[float]]:
    """(prefill tok/s, decode tok/s, ITL p50 ms, ITL p90 ms, the median run's ITLs in ms)."""
    rng = random.Random(next(_runs))
    engine = llm.engine
    step_times(engine, random_prompt(rng, 16), 4)  # warm-up: first-call costs
    prefill = max(prefill_len / step_times(engine, random_prompt(rng, prefill_len), 1)[0]
                  for _ in range(repeats))
    runs = []
    for _ in range(repeats):
        stamps = step_times(engine, random_prompt(rng, prompt_len), decode_tokens)
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        runs.append((len(gaps) / (stamps[-1] - stamps[0]), gaps))
    rate, in_order = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    gaps = sorted(in_order)
    return (prefill, rate, 1000 * gaps[len(gaps) // 2],
            1000 * gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))], [1000 * g for g in in_order])


def load_llm(args):
    from quire import LLM
    kw, note = engine_kwargs(args)
    llm = LLM(**kw)
    return llm, note


def run(args, llm=None, note: str = "") -> SingleStream:
    import torch
    if llm is None:
        llm, note = load_llm(args)
    prefill, rate, p50, p90, itl = measure(llm, args.prompt_len, args.decode_tokens,
                                           args.prefill_len, args.repeats)
    e = llm.engine
    quant = getattr(e.args, "quantization", None)
    if getattr(e.args, "activation_quantization", "none") != "none":
        quant = f"{quant}, activations {e.args.activation_quantization}"
    try:  # (an older tree's runtime, through PYTHONPATH, has no huge pages)
        from quire.native import huge_pages
        pages = ", packed weights on huge pages" if huge_pages.available() else ""
    except ImportError:
        pages = ""
    desc = (f"quire ({str(e.dtype).removeprefix('torch.')}"
            f"{', quantization ' + str(quant) if quant else ''}, attention "
            f"{e.attention_backend}{pages})")
    return SingleStream(prefill, rate, p50, p90, torch.get_num_threads(),
                        desc + (f"; {note}" if note else ""), itl)


def add_common_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="default: the SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--dtype", default=None, help="Quire's dtype (default: auto)")
    ap.add_argument("--quantization", default=None,
                    help="none/int8/int4/auto, passed to LLM() where Quire has the option")
    ap.add_argument("--activation-quantization", default=None, choices=["none", "int8"],
                    help="Quire's --activation-quantization (int8: int4 weights' kernels "
                         "round x to int8, as llama.cpp does)")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="torch threads (default: the CPU quota, as Quire picks)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 32-token decode, 128-token prefill, one repeat")


def apply_quick(args) -> None:
    if args.quick:
        args.decode_tokens, args.prefill_len, args.repeats = 32, 128, 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_flags(ap)
    add_plot_flag(ap, "single_stream")
    args = ap.parse_args()
    apply_quick(args)
    with StealMeter() as steal:
        r = run(args)
    print(describe_machine(r.threads))
    print(r.engine_note)  # the engine, and a note where a flag was ignored
    print(f"prefill ({args.prefill_len} tokens): {r.prefill_tok_s:.1f} tok/s")
    print(f"decode ({args.prompt_len}-token prompt, {args.decode_tokens} tokens): "
          f"{r.decode_tok_s:.1f} tok/s, inter-token latency p50 {r.itl_p50_ms:.1f} ms, "
          f"p90 {r.itl_p90_ms:.1f} ms")
    print(f"threads {r.threads}; {steal}")
    if args.plot:
        positions = list(range(args.prompt_len + 2, args.prompt_len + 2 + len(r.itl_ms)))
        line_panels(args.plot, f"Single stream: {r.decode_tok_s:.1f} decode tok/s, prefill "
                    f"{r.prefill_tok_s:.0f} tok/s", "context length (tokens)",
                    [("inter-token latency (ms)", {"Quire": (positions, r.itl_ms)})],
                    caption=f"{r.engine_note}; {machine_caption(r.threads)}")


if __name__ == "__main__":
    main()
