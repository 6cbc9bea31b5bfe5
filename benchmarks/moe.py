"""Mixture-of-experts: the fused layer against a per-expert loop, a whole MoE model's offline
throughput beside transformers', and the resident memory of a quantized MoE, in one run.

1. The layer alone (layers/fused_moe), random experts, at 1, 16 and 256 tokens: the
   per-expert loop (reference.py, transformers' eager order: per chosen expert a gather, one
   gate/up and one down F.linear on its plain weights, an index_add_) against the fused path
   this device takes, per weight format. CPU: the grouped path (pairs sorted once, one
   F.grouped_mm per projection in float32; in bfloat16 each expert's oneDNN-packed weight in
   turn, with the one-grouped_mm time beside it; int8/int4: each expert's native kernel).
   CUDA: the Triton kernel, the dense-equivalent (one dense MLP of intermediate top_k * I
   over the same tokens: the same FLOPs, no routing) and the kernel's TFLOP/s.
2. A tiny-but-not-trivial random MoE model (Mixtral-shaped: --model-* flags), N random-token
   requests with ignore_eos, greedy: Quire, and transformers' generate at each batch size and
   dtype (left-padded, requests sorted by length: its best case); the best is compared.
3. That model loaded in a fresh process per quantization (none, int8, int4): resident memory
   after load (VmRSS), its peak (VmHWM), and the weight bytes Quire counts (parameter_bytes,
   what the KV budget leaves room for).

    python benchmarks/moe.py                 # everything, default sizes
    python benchmarks/moe.py --quick         # small sizes: a minute or two
    python benchmarks/moe.py --device cuda   # the Triton kernel (sections 1 and 2 on the GPU)
    python benchmarks/moe.py --skip-model --skip-rss   # the layer only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

from machine import StealMeter, describe_machine

TOKENS = (1, 16, 256)
FORMATS = ("none", "int8", "int4")


# --- 1. the layer ---------------------------------------------------------------------------
def make_layer(args, quant: str, dtype):
    import torch

    from quire.layers.fused_moe import FusedMoE, softmax_topk
    from quire.layers.quantization import QuantizeOnLoadConfig
    qc = None if quant == "none" else QuantizeOnLoadConfig(quant, 64 if quant == "int4" else None)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = FusedMoE(args.experts, args.top_k, args.hidden, args.intermediate,
                         functools.partial(softmax_topk, top_k=args.top_k, renormalize=True),
                         quant_config=qc, prefix="layers.0.mlp.experts")
    finally:
        torch.set_default_dtype(old)
    layer.keep_canonical = args.device == "cuda"  # the Triton kernel reads them
    g = torch.Generator().manual_seed(0)
    for e in range(args.experts):
        for shard, shape in (("w1", (args.intermediate, args.hidden)),
                             ("w3", (args.intermediate, args.hidden))):
            layer.weight_loader(layer.w13_weight, torch.randn(shape, generator=g).to(dtype) * 0.02,
                                e, shard)
        layer.weight_loader(layer.w2_weight,
                            torch.randn(args.hidden, args.intermediate, generator=g).to(dtype)
                            * 0.02, e, "w2")
    return layer.to(args.device)


def timed(fn, device: str, min_time: float = 0.5, max_reps: int = 200) -> float:
    """Seconds per call: warm-up, then repeated until min_time has passed."""
    import torch
    fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    reps, start = 0, time.perf_counter()
    while reps < max_reps and (reps < 3 or time.perf_counter() - start < min_time):
        fn()
        reps += 1
    sync()
    return (time.perf_counter() - start) / reps


def dense_mlp(x, w1, w2):
    """The dense-equivalent of the experts: one gated MLP of intermediate top_k * I."""
    import torch.nn.functional as F
    gate, up = F.linear(x, w1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def bench_layer(args) -> None:
    import torch
    dtype = getattr(torch, args.dtype)
    fused = "triton" if args.device == "cuda" else "grouped"
    print(f"\n## MoE layer: hidden {args.hidden}, expert intermediate {args.intermediate}, "
          f"{args.experts} experts, top {args.top_k}, {args.dtype}, {args.device}")
    print(f"| format | tokens | per-expert loop | fused ({fused}) | speedup |"
          + (" dense-equivalent | fused TFLOP/s |" if args.device == "cuda" else ""))
    print("|---|---|---|---|---|" + ("---|---|" if args.device == "cuda" else ""))
    for quant in args.formats:
        layer = make_layer(args, quant, dtype)
        for t in args.tokens:
            g = torch.Generator().manual_seed(t)
            x = torch.randn(t, args.hidden, generator=g).to(dtype).to(args.device)
            logits = torch.randn(t, args.experts, generator=g).to(args.device)
            weights, ids = layer.router(logits)
            times = {}
            for impl in ("loop", fused):
                layer.impl = impl
                times[impl] = timed(functools.partial(layer.experts, x, weights, ids),
                                    args.device)
            row = (f"| {quant} | {t} | {times['loop'] * 1e6:.0f} us | "
                   f"{times[fused] * 1e6:.0f} us | {times['loop'] / times[fused]:.2f}x |")
            packed = getattr(layer, "packed_experts", None)
            if packed is not None:  # bf16 on CPU: what one F.grouped_mm call would take
                layer.packed_experts = None
                grouped_mm = timed(functools.partial(layer.experts, x, weights, ids),
                                   args.device)
                layer.packed_experts = packed
                row += f" (one F.grouped_mm per projection instead: {grouped_mm * 1e6:.0f} us)"
            if args.device == "cuda":
                w1 = torch.randn(2 * args.top_k * args.intermediate, args.hidden, dtype=dtype,
                                 device=args.device) * 0.02
                w2 = torch.randn(args.hidden, args.top_k * args.intermediate, dtype=dtype,
                                 device=args.device) * 0.02
                dense_t = timed(functools.partial(dense_mlp, x, w1, w2), args.device)
                flops = 2 * t * args.top_k * 3 * args.hidden * args.intermediate
                row += f" {dense_t * 1e6:.0f} us | {flops / times[fused] / 1e12:.2f} |"
            print(row)
        layer = None  # the next format's experts replace these


# --- 2. a whole model -----------------------------------------------------------------------
def model_folder(args) -> str:
    """A random Mixtral-shaped model with SmolLM2's tokenizer, saved once."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig
    shape = (f"h{args.model_hidden}-l{args.model_layers}-e{args.model_experts}-"
             f"k{args.model_top_k}-i{args.model_intermediate}")
    folder = os.path.join(os.path.expanduser("~/.cache/quire/bench-moe"), shape)
    if os.path.exists(os.path.join(folder, ".complete")):
        return folder
    from quire.models.loader import load_tokenizer, materialize, resolve_model
    tokenizer = load_tokenizer(materialize(resolve_model(None)), None)
    heads = max(1, args.model_hidden // 64)
    cfg = MixtralConfig(vocab_size=len(tokenizer), hidden_size=args.model_hidden,
                        intermediate_size=args.model_intermediate,
                        num_hidden_layers=args.model_layers, num_attention_heads=heads,
                        num_key_value_heads=max(1, heads // 4), head_dim=64,
                        num_local_experts=args.model_experts,
                        num_experts_per_tok=args.model_top_k, max_position_embeddings=4096,
                        bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    open(os.path.join(folder, ".complete"), "w").close()
    return folder


def bench_model(args, folder: str) -> None:
    from throughput import make_requests, run_hf

    from quire import LLM, SamplingParams
    reqs = [(p[:args.max_prompt], min(m, args.max_output))
            for p, m in make_requests(args.num_requests, 0)]
    print(f"\n## Offline throughput: {folder} ({args.num_requests} requests, prompts up to "
          f"{args.max_prompt}, outputs up to {args.max_output} tokens, ignore_eos, greedy)")
    llm = LLM(folder, dtype=args.dtype, device=args.device, num_threads=args.num_threads)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    llm.generate([p for p, _ in reqs[:4]], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    with StealMeter() as steal:
        outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
        if args.device == "cuda":
            import torch
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    quire = generated / wall
    print(f"quire ({args.dtype}): {len(reqs)} requests in {wall:.1f} s, {quire:.1f} generated "
          f"tok/s, {steal}")
    del llm, outs
    best = None
    for dtype in args.hf_dtypes:
        for batch in args.hf_batches:
            tps = run_hf(reqs, batch, dtype, args.hf_limit, folder, args.device)
            if best is None or tps > best[0]:
                best = (tps, dtype, batch)
    if best is not None:
        print(f"Quire / best transformers ({best[1]}, batch {best[2]}) = {quire / best[0]:.2f}x")


# --- 3. resident memory per quantization ---------------------------------------------------------
_RSS_CHILD = """
import json, sys
from quire import LLM
from quire.worker.model_builder import parameter_bytes
folder, dtype, quant = sys.argv[1:4]
llm = LLM(folder, dtype=dtype, quantization=quant, kv_cache_memory=1 << 20)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
kb = lambda k: int(status[k].split()[0]) * 1024
print(json.dumps({"rss": kb("VmRSS"), "peak": kb("VmHWM"),
                  "weights": parameter_bytes(llm.engine.executor.model)}))
"""


def bench_rss(args, folder: str) -> None:
    print(f"\n## Resident memory after load ({folder}, {args.dtype}, a fresh process each)")
    print("| quantization | VmRSS | peak (VmHWM) | weight bytes (parameter_bytes) |")
    print("|---|---|---|---|")
    for quant in args.formats:
        child = subprocess.run([sys.executable, "-c", _RSS_CHILD, folder, args.dtype, quant],
                               capture_output=True, text=True)
        if child.returncode:
            print(f"| {quant} | failed: {child.stderr.strip().splitlines()[-1:]} | | |")
            continue
        r = json.loads(child.stdout.strip().splitlines()[-1])
        mib = 1 << 20
        print(f"| {quant} | {r['rss'] / mib:.0f} MiB | {r['peak'] / mib:.0f} MiB | "
              f"{r['weights'] / mib:.0f} MiB |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    # the layer: Qwen3-30B-A3B's hidden and expert sizes, a quarter of its experts
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    # the model: ~0.2B parameters, ~60M active
    ap.add_argument("--model-hidden", type=int, default=512)
    ap.add_argument("--model-layers", type=int, default=6)
    ap.add_argument("--model-experts", type=int, default=8)
    ap.add_argument("--model-top-k", type=int, default=2)
    ap.add_argument("--model-intermediate", type=int, default=1024)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--hf-batches", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--hf-dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--hf-limit", type=int, default=16,
                    help="time transformers on an evenly spaced subset of this many requests")
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="small sizes everywhere: checks that the benchmark runs")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.experts, args.top_k = 256, 128, 8, 2
        args.model_hidden, args.model_layers, args.model_intermediate = 128, 2, 256
        args.num_requests, args.max_prompt, args.max_output = 8, 64, 16
        args.hf_batches, args.hf_dtypes, args.hf_limit = [8], ["float32"], 8
    if args.num_threads:
        import torch
        torch.set_num_threads(args.num_threads)
    print(describe_machine(args.num_threads))
    with StealMeter() as steal:
        if not args.skip_layer:
            bench_layer(args)
        if not (args.skip_model and args.skip_rss):
            folder = model_folder(args)
            if not args.skip_model:
                bench_model(args, folder)
            if not args.skip_rss and args.device == "cpu":
                bench_rss(args, folder)
    print(f"\nwhole run: {steal}")


if __name__ == "__main__":
    main()
