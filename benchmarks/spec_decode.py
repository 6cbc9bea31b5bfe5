"""Speculative decoding, single stream on the default model, beside llama.cpp in one run.

Two prompts through the chat template: a copy-heavy one (a passage the model is asked to
repeat) and a plain chat one. Each runs on Quire without speculation and with n-gram
speculation (`--spec-config`), and on llama-server without and with its n-gram speculation
(`--spec-type ngram-simple`), all greedy with the same threads; decode tok/s is (tokens after
the first) / (time after the first token); the engines take turns, round by round, and each
figure is the median of its rounds. Quire's acceptance rate comes from its counters,
llama-server's from its timings. llama-bench's tg256 is printed for reference.

    python benchmarks/spec_decode.py
    python benchmarks/spec_decode.py --rounds 5 --max-tokens 256 --plot
    python benchmarks/spec_decode.py --quick          # one round, 64 tokens, Quire only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import urllib.request

from llamacpp_compare import find_llama_bench, llama_bench
from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars
from processes import free_port, stop, wait_ready

LLAMA_SERVER = "/tmp/llamabuild/bin/llama-server"
PASSAGE = (
    "The lighthouse stood at the end of a long stone pier, and for forty years the same "
    "keeper climbed its spiral stairs every evening to light the lamp. He kept a logbook of "
    "every ship that passed, the direction of the wind, and the colour of the sky at dusk. "
    "In winter the waves broke over the pier and froze into strange white shapes, and in "
    "summer children from the village came to fish from the rocks below. When the keeper "
    "finally retired, the logbooks filled three shelves of the small museum in the harbour, "
    "and visitors still read them to learn how the sea had changed over the decades.")
PROMPTS = {
    "copy-heavy": f"{PASSAGE}\n\nRepeat the passage above exactly, word for word.",
    "plain chat": "Write a short story about a cat who learns to play the piano.",
}


def chat_prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def quire_decode(llm, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(decode tok/s, tokens) of one greedy request, timed per engine step."""
    from quire import SamplingParams
    e = llm.engine
    e.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    first = last = None
    tokens = 0
    while e.has_unfinished_requests():
        outs = e.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n and first is None:
                first, tokens = now, n
            elif n > tokens:
                last, tokens = now, n
    return (tokens - 1) / (last - first) if last else 0.0, tokens


def llama_decode(url: str, text_prompt: str, max_tokens: int) -> tuple[float, int, float | None]:
    body = {"prompt": text_prompt, "n_predict": max_tokens, "temperature": 0,
            "cache_prompt": False}
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        t = json.loads(r.read())["timings"]
    rate = None
    if t.get("draft_n"):
        rate = t.get("draft_n_accepted", 0) / t["draft_n"]
    return t["predicted_per_second"], t["predicted_n"], rate


def start_llama(binary: str, gguf: str, threads: int, extra: list[str]):
    port = free_port()
    proc = subprocess.Popen([binary, "-m", gguf, "-t", str(threads), "-np", "1", "-c", "4096",
                             "--host", "127.0.0.1", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url)
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--spec-config", default=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}), help="Quire's speculative_config (JSON)")
    ap.add_argument("--llama-server", default=LLAMA_SERVER)
    ap.add_argument("--llama-spec", default="--spec-type ngram-simple --spec-ngram-simple-size-n 3 "
                    "--spec-ngram-simple-size-m 8", help="llama-server's speculation flags")
    ap.add_argument("--llama-bench", default=None, help="default: /tmp/llamabuild's, or PATH's")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--activation-quantization", default="none", choices=["none", "int8"],
                    help="both Quire engines' --activation-quantization")
    add_plot_flag(ap, "spec_decode")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.max_tokens, args.skip_llama = 1, 64, True
    from quire import LLM
    from quire.cpu_threads import detect_quota
    from quire.models.loader import default_model_path
    threads = args.num_threads or detect_quota().cpus
    print(describe_machine(threads))
    spec = json.loads(args.spec_config)
    act = {"activation_quantization": args.activation_quantization}
    engines = {"Quire": LLM(num_threads=threads, **act),
               "Quire + n-gram": LLM(num_threads=threads, speculative_config=spec, **act)}
    tokenizer = engines["Quire"].engine.tokenizer
    prompts = {name: chat_prompt(tokenizer, text) for name, text in PROMPTS.items()}
    servers = {}
    if not args.skip_llama and os.access(args.llama_server, os.X_OK):
        gguf = default_model_path()
        servers["llama-server"] = start_llama(args.llama_server, gguf, threads, [])
        servers["llama-server + n-gram"] = start_llama(args.llama_server, gguf, threads,
                                                       args.llama_spec.split())
    runs: dict[tuple[str, str], list[float]] = {}
    rates: dict[tuple[str, str], list[float]] = {}
    counts: dict[tuple[str, str], int] = {}
    try:
        with StealMeter() as steal:
            for llm in engines.values():  # warm-up: first-call costs
                quire_decode(llm, prompts["plain chat"], 8)
            for rnd in range(args.rounds):
                for pname, prompt in prompts.items():
                    text = tokenizer.decode(prompt)
                    order = list(engines) + list(servers)
                    if rnd % 2:
                        order.reverse()
                    for who in order:
                        key = (pname, who)
                        if who in engines:
                            llm = engines[who]
                            before = llm.engine.speculator.counters if llm.engine.speculator \
                                else None
                            rate, n = quire_decode(llm, prompt, args.max_tokens)
                            if before is not None:
                                c = llm.engine.speculator.drain()
                                rates.setdefault(key, []).append(
                                    c.num_accepted_tokens / max(1, c.num_draft_tokens))
                        else:
                            rate, n, accepted = llama_decode(servers[who][1], text,
                                                             args.max_tokens)
                            if accepted is not None:
                                rates.setdefault(key, []).append(accepted)
                        runs.setdefault(key, []).append(rate)
                        counts[key] = n
                print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    print(f"\n{threads} threads; {args.rounds} alternating rounds, medians; greedy, up to "
          f"{args.max_tokens} tokens; Quire {args.spec_config}, activations "
          f"{args.activation_quantization}; llama-server {args.llama_spec}; "
          f"{steal}")
    print("| prompt | engine | decode tok/s | tokens | acceptance | vs the same engine without |")
    print("|---|---|---|---|---|---|")
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for (pname, who), value in medians.items():
        base = medians.get((pname, who.replace(" + n-gram", "")))
        rate = rates.get((pname, who))
        print(f"| {pname} | {who} | {value:.1f} | {counts[(pname, who)]} | "
              f"{f'{100 * statistics.median(rate):.0f}%' if rate else '-'} | "
              f"{f'{value / base:.2f}x' if base and base != value else '-'} |")
    bench = None if args.skip_llama else find_llama_bench(args.llama_bench)
    if bench is not None:  # plain decode from an empty context, for reference
        tg = llama_bench(bench, default_model_path(), threads, 0, args.max_tokens, 3)
        print(f"llama-bench tg{args.max_tokens} ({threads} threads, 3 reps): "
              f"{tg.get('decode', float('nan')):.1f} tok/s")
    if args.plot:
        names = list(dict.fromkeys(who for _, who in medians))
        grouped_bars(args.plot, "Single-stream decode with and without speculation",
                     "decode tok/s", list(PROMPTS),
                     {who: [medians.get((p, who), 0.0) for p in PROMPTS] for who in names},
                     caption=machine_caption(threads))


if __name__ == "__main__":
    main()
