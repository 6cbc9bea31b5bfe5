"""Quire against llama.cpp on the same GGUF file, the same threads, in one run.

llama-bench (built by ../shared/anchors/build_llamacpp.sh into /tmp/llamabuild) measures
prefill of 512 tokens (pp512) and decode of 256 tokens (tg256); Quire measures the same
(single_stream.py: a 512-token prompt, then a 128-token prompt and 256 decoded tokens).
The two alternate, round by round (and who goes first alternates too), so neither gets the
quieter slot of a shared machine; each engine's figure is the median of its rounds.

Then the memory roofline: at batch 1, decode reads every weight once per token, plus the KV
cache of the tokens so far. Bytes per token (weights at their stored sizes: the GGUF tensors
for llama.cpp, Quire's own parameter and packed-weight bytes; KV at each engine's mean
context) divided into the measured read bandwidth (a streaming sum over 1 GiB with the same
threads) is the ceiling tok/s; each engine's decode is shown as a % of it.

    python benchmarks/llamacpp_compare.py
    python benchmarks/llamacpp_compare.py --num-threads 2 --rounds 3 --llama-bench PATH
    python benchmarks/llamacpp_compare.py --quick
    python benchmarks/llamacpp_compare.py --plot     # and plots/llamacpp_compare.png
    python benchmarks/llamacpp_compare.py --with-int8-activations

`--with-int8-activations` adds a second Quire engine with `--activation-quantization int8`
(its int4 kernels round x to int8 per 32 values, as llama.cpp's Q8 activations do) to the
rounds, beside the default one: the two arithmetics, and llama.cpp's, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import time

import single_stream
from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars

DEFAULT_LLAMA_BENCH = "/tmp/llamabuild/bin/llama-bench"
# never part of the weights a decode step reads: RoPE tables, masks
NOT_WEIGHTS = ("cos", "sin", "inv_freq", "mask")


def find_llama_bench(path: str | None) -> str | None:
    for p in (path, DEFAULT_LLAMA_BENCH, shutil.which("llama-bench")):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def llama_bench(binary: str, gguf: str, threads: int, prefill: int, decode: int,
                reps: int) -> dict[str, float]:
    """{'prefill': tok/s, 'decode': tok/s} from one llama-bench run."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", str(prefill), "-n", str(decode),
           "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    rows = json.loads(out.stdout)
    got = {}
    for row in rows:
        if row.get("n_prompt") and not row.get("n_gen"):
            got["prefill"] = float(row["avg_ts"])
        elif row.get("n_gen") and not row.get("n_prompt"):
            got["decode"] = float(row["avg_ts"])
    return got


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (torch sum over a float32 tensor larger than any cache),
    best of `repeats`, with torch at `threads` threads."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
        x.sum()  # touch every page once
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        return x.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def gguf_weight_bytes(path: str) -> tuple[int, int]:
    """(bytes of every tensor in the file, bytes of the token-embedding table). A decode step
    reads each tensor whole, except the embedding (one row) unless it is also the output."""
    from gguf import GGUFReader
    reader = GGUFReader(path)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    names = {t.name: int(t.n_bytes) for t in reader.tensors}
    embd = names.get("token_embd.weight", 0)
    tied = "output.weight" not in names
    return total, 0 if tied else embd


def quire_weight_bytes(model) -> int:
    """Bytes a Quire decode step reads: each module's packed weight where it has one (the float
    copy then sits unread), its other parameters and weight buffers, each storage once. An
    embedding table is looked up one row per token, so it counts only through the LM head
    (tied or not, the head reads its whole weight, or its packed copy)."""
    import torch
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) or "embed" in type(module).__name__.lower():
            continue
        packed = getattr(module, "packed_weight", None)
        tensors = [(n, t) for n, t in module.named_parameters(recurse=False)]
        tensors += [(n, t) for n, t in module.named_buffers(recurse=False)
                    if not any(s in n for s in NOT_WEIGHTS)]
        if packed is not None:
            tensors = [(n, t) for n, t in tensors if n != "weight"] + [("packed", packed)]
        kernel = getattr(module, "quant_kernel", None)
        if kernel is not None and kernel.extra_bytes():
            # a quantized layer multiplies by its kernel's packed copy; its canonical
            # qweight/scales (kept only where lookups read them) sit unread by the matmul
            total += kernel.extra_bytes()
            tensors = [(n, t) for n, t in tensors if n == "bias"]
        for _, t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() and _key(t) not in seen:
                seen.add(_key(t))
                total += t.numel() * t.element_size()
    return total


def _key(t) -> int:
    """A tensor's storage, for counting shared weights once (an opaque packed tensor has no
    storage pointer: it is its own)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return id(t)


def kv_bytes_per_token(cfg, mean_context: float, bytes_per_value: int) -> float:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * bytes_per_value * mean_context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    single_stream.add_common_flags(ap)
    add_plot_flag(ap, "llamacpp_compare")
    ap.add_argument("--llama-bench", default=None,
                    help=f"llama-bench binary (default: {DEFAULT_LLAMA_BENCH} or on PATH)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds; llama-bench runs -r --llama-reps in each")
    ap.add_argument("--llama-reps", type=int, default=1)
    ap.add_argument("--with-int8-activations", action="store_true",
                    help="also a Quire engine with --activation-quantization int8")
    args = ap.parse_args()
    single_stream.apply_quick(args)
    if args.quick:
        args.rounds = 1
    args.repeats = 1  # one Quire measurement per round; the rounds give the repeats

    import torch

    from quire.cpu_threads import detect_quota
    from quire.models.loader import default_model_path
    gguf = args.model or default_model_path()
    if not gguf.endswith(".gguf"):
        raise SystemExit("--model must be a .gguf file: llama.cpp reads the same file")
    threads = args.num_threads or detect_quota().cpus
    args.num_threads = threads
    binary = find_llama_bench(args.llama_bench)
    print(describe_machine(threads))
    if binary is None:
        print(f"llama-bench not found (looked at --llama-bench, {DEFAULT_LLAMA_BENCH}, PATH): "
              "run ../shared/anchors/build_llamacpp.sh; Quire only")

    engines = {"quire": single_stream.load_llm(args)}
    if args.with_int8_activations:
        engines["quire int8"] = single_stream.load_llm(
            argparse.Namespace(**{**vars(args), "activation_quantization": "int8"}))
    for _, note in engines.values():
        if note:
            print(note)
    llm = engines["quire"][0]
    runs = {name: [] for name in engines}
    llama_runs = []
    with StealMeter() as steal:
        for rnd in range(args.rounds):
            order = ["llama", *engines] if rnd % 2 == 0 else [*engines, "llama"]
            for who in order:
                if who in engines:
                    runs[who].append(single_stream.run(args, *engines[who]))
                elif binary is not None:
                    llama_runs.append(llama_bench(binary, gguf, threads, args.prefill_len,
                                                  args.decode_tokens, args.llama_reps))
            print(f"round {rnd + 1}/{args.rounds}: "
                  + ", ".join(f"{name} decode {r[-1].decode_tok_s:.1f} tok/s"
                              for name, r in runs.items())
                  + (f", llama.cpp decode {llama_runs[-1].get('decode', 0):.1f} tok/s"
                     if llama_runs else ""), flush=True)
        bandwidth = read_bandwidth(threads)
    quire_runs = runs["quire"]
    medians = {name: {"prefill": statistics.median(x.prefill_tok_s for x in r),
                      "decode": statistics.median(x.decode_tok_s for x in r)}
               for name, r in runs.items()}
    q = medians["quire"]
    ll = ({k: statistics.median(r[k] for r in llama_runs) for k in ("prefill", "decode")}
          if llama_runs else None)

    cfg = llm.engine.model_config
    kv_value_bytes = torch.empty((), dtype=llm.engine.kv_dtype).element_size()
    quire_bytes = (quire_weight_bytes(llm.engine.executor.model)
                   + kv_bytes_per_token(cfg, args.prompt_len + args.decode_tokens / 2,
                                        kv_value_bytes))
    file_bytes, unread_embd = gguf_weight_bytes(gguf)
    llama_bytes = file_bytes - unread_embd + kv_bytes_per_token(cfg, args.decode_tokens / 2, 2)

    notes = "; ".join(r[-1].engine_note for r in runs.values())
    print(f"\n{notes}; llama.cpp {binary or '(not run)'}; "
          f"{threads} threads each; {args.rounds} alternating rounds, medians; {steal}")
    print(f"| | prefill {args.prefill_len} tok/s | decode tok/s | bytes/token | "
          f"roofline tok/s | % of roofline |")
    print("|---|---|---|---|---|---|")
    bars = {}
    rows = [("Quire", q, quire_bytes)]
    if "quire int8" in medians:
        rows.append(("Quire, int8 activations", medians["quire int8"], quire_bytes))
    for name, fig, nbytes in (*rows, ("llama.cpp", ll, llama_bytes)):
        ceiling = bandwidth / nbytes
        if fig is not None:
            bars[name] = [fig["decode"], ceiling]
        if fig is None:
            print(f"| {name} | - | - | {nbytes / 1e6:.1f} MB | {ceiling:.0f} | - |")
            continue
        print(f"| {name} | {fig['prefill']:.1f} | {fig['decode']:.1f} | {nbytes / 1e6:.1f} MB "
              f"| {ceiling:.0f} | {100 * fig['decode'] / ceiling:.0f}% |")
    if ll:
        for name, fig, _ in rows:
            print(f"{name} / llama.cpp: prefill {fig['prefill'] / ll['prefill']:.2f}x, decode "
                  f"{fig['decode'] / ll['decode']:.2f}x")
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({threads} threads, 1 GiB float32 sum, "
          f"best of 5); Quire ITL p50 {quire_runs[-1].itl_p50_ms:.1f} ms, p90 "
          f"{quire_runs[-1].itl_p90_ms:.1f} ms; llama.cpp tg starts from an empty context, "
          f"Quire's decode after a {args.prompt_len}-token prompt (KV counted at each's mean)")
    if args.plot:
        title = f"Single-stream decode: prefill {args.prefill_len} Quire {q['prefill']:.0f} tok/s"
        if ll:
            title += f", llama.cpp {ll['prefill']:.0f} tok/s"
        grouped_bars(args.plot, title, "tok/s", ["decode (median)", "memory roofline"], bars,
                     caption=machine_caption(threads))


if __name__ == "__main__":
    main()
