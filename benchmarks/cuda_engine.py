"""Quire on a CUDA GPU: greedy parity with transformers on the same weights, then offline
throughput with CUDA graphs, eagerly, and weight-only quantized (the Triton int8/int4
kernels), beside transformers' batched generate on the same GPU in the same run.

Nothing downloads on the GPU machines this was written for, so the model is random weights in
a real model's shape (`--shape`) with a word-level tokenizer. Throughput depends only on the
shapes and lengths: every request generates exactly `--output-len` tokens (ignore_eos), and
transformers is held to the same count (min_new_tokens).

    python benchmarks/cuda_engine.py [--shape smollm2-135m|llama-1b] [--num-requests 256]

Parity: float32 weights (initializer_range 0.08, so logits are peaked enough that greedy is a
property of the model, not of summation order), transformers one prompt at a time against
Quire with the Triton backend and CUDA graphs, eagerly, and on the torch backend.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
import traceback

import torch

DEVICE = "cuda"  # --device cpu: a smoke test of this script on a machine without a GPU

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=1024),
    # SmolLM2-135M-Instruct's config
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192),
    # Llama-3.2-1B's
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                     tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=8192),
}


def word_tokenizer(vocab: int):
    """Builds in a second; ids 0-2 are unk/bos/eos, so random prompts avoid them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1",
                                   eos_token="w2")


def save_model(path: str, shape: str, initializer_range: float, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(**SHAPES[shape], initializer_range=initializer_range, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(path)
    word_tokenizer(cfg.vocab_size).save_pretrained(path)
    del model
    free_gpu()
    return path


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def free_gpu() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def peak_memory() -> str:
    if DEVICE != "cuda":
        return ""
    return f", peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"


# --------------------------------------------------------------------------------- parity

def hf_greedy(path: str, prompts, max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=DEVICE)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, min_new_tokens=max_new,
                                 pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    del model
    free_gpu()
    return outs


def quire_greedy(path: str, prompts, max_new: int, **engine) -> list[list[int]]:
    from quire import LLM, SamplingParams
    llm = LLM(path, device=DEVICE, **engine)
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    used = llm.engine.kv_manager.pool.num_used_blocks
    graphs = llm.engine.executor.runner.cuda_graphs
    captured = sorted(graphs.graphs) if graphs is not None else "none (eager)"
    del llm
    free_gpu()
    print(f"    blocks in use after the run: {used}; CUDA graphs captured for buckets: "
          f"{captured}")
    return outs


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def parity(args, tmp: str) -> bool:
    path = save_model(f"{tmp}/parity", args.shape, initializer_range=0.08)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = random_prompts(args.parity_prompts, 1, 300, vocab, seed=1)
    want = hf_greedy(path, prompts, args.parity_tokens)
    ok = True
    runs = {"triton + CUDA graphs": dict(attention_backend="triton"),
            "triton, eager": dict(attention_backend="triton", enforce_eager=True),
            "torch backend": dict(attention_backend="torch", enforce_eager=True),
            "triton + CUDA graphs, chunked prefill (64-token budget)":
                dict(attention_backend="triton", max_num_batched_tokens=64)}
    for name, engine in runs.items():
        got = quire_greedy(path, prompts, args.parity_tokens, dtype="float32",
                           kv_cache_memory=args.kv_cache_gib << 30, **engine)
        diverged = [d for a, b in zip(got, want) if (d := first_divergence(a, b)) is not None]
        same = len(prompts) - len(diverged)
        ok &= same == len(prompts)
        print(f"PARITY {name}: {same}/{len(prompts)} sequences token-for-token equal to "
              f"transformers (float32, {args.parity_tokens} tokens)"
              + (f"; first divergences at {diverged}" if diverged else ""))
    return ok


# ----------------------------------------------------------------------------- throughput

def quire_throughput(path: str, prompts, output_len: int, dtype: str, label: str,
                     **engine) -> None:
    from quire import LLM, SamplingParams
    llm = LLM(path, device=DEVICE, dtype=dtype, **engine)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:16], params, use_tqdm=False)  # warm-up: Triton compiles, graphs
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert llm.engine.kv_manager.pool.num_used_blocks == 0, "KV blocks leaked"
    print(f"QUIRE {dtype} {label}: {generated / elapsed:,.0f} output tok/s "
          f"({len(prompts)} requests, {generated} tokens, {elapsed:.2f} s){peak_memory()}")
    del llm
    free_gpu()


def hf_generate(model, batch: list[list[int]], output_len: int) -> int:
    """One left-padded batch through generate; returns the tokens it generated."""
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=DEVICE)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=output_len, min_new_tokens=output_len,
                             pad_token_id=0)
    return out.shape[0] * (out.shape[1] - width)


def hf_throughput(path: str, prompts, output_len: int, dtype: str,
                  batch_sizes: list[int]) -> None:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.to(DEVICE).eval()
    for bs in batch_sizes:
        hf_generate(model, prompts[:bs], output_len)  # warm-up
        sync()
        done, start = 0, time.perf_counter()
        for i in range(0, len(prompts), bs):
            done += hf_generate(model, prompts[i:i + bs], output_len)
        sync()
        elapsed = time.perf_counter() - start
        print(f"HF {dtype} batch {bs}: {done / elapsed:,.0f} output tok/s "
              f"({len(prompts)} requests, {elapsed:.2f} s)")
    del model
    free_gpu()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512), metavar=("LO", "HI"))
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="*", default=[32, 64, 128])
    ap.add_argument("--hf-requests", type=int, default=128,
                    help="transformers runs the first N requests (tok/s is per its own time)")
    ap.add_argument("--quantizations", nargs="*", default=["int8", "int4"])
    ap.add_argument("--parity-prompts", type=int, default=8)
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--kv-cache-gib", type=int, default=16)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: only to smoke-test this script")
    ap.add_argument("--save-model", metavar="DIR", default=None,
                    help="only write the benchmark's random-weight model (--shape, float32) to "
                         "DIR, for benchmarks/throughput.py --model DIR")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.save_model:
        print(f"saved {save_model(args.save_model, args.shape, initializer_range=0.02)}")
        return 0
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU")
        return 2
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, shape "
          f"{args.shape}, dtype {args.dtype}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_parity:
            ok = parity(args, tmp)
        if not args.skip_throughput:
            path = save_model(f"{tmp}/bench", args.shape, initializer_range=0.02,
                              dtype=getattr(torch, args.dtype))
            vocab = SHAPES[args.shape]["vocab_size"]
            prompts = random_prompts(args.num_requests, *args.prompt_len, vocab)
            print(f"workload: {len(prompts)} requests, prompts {args.prompt_len[0]}-"
                  f"{args.prompt_len[1]} tokens, {args.output_len} out each")
            run = (path, prompts, args.output_len, args.dtype)
            kv = dict(kv_cache_memory=args.kv_cache_gib << 30)
            configs = {"CUDA graphs": {}, "eager": dict(enforce_eager=True)}
            configs.update({f"{q} + CUDA graphs": dict(quantization=q)
                            for q in args.quantizations})
            for label, engine in configs.items():
                try:  # one configuration failing still leaves the others' figures
                    quire_throughput(*run, label, **engine, **kv)
                except Exception:
                    ok = False
                    print(f"QUIRE {label}: FAILED")
                    traceback.print_exc()
                    free_gpu()
            hf_throughput(path, prompts[:args.hf_requests], args.output_len, args.dtype,
                          args.hf_batch_sizes)
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
