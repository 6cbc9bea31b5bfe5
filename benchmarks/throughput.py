"""Offline throughput: Quire vs transformers' generate (and llama-server) on the same requests.

N requests (seeded; 32 by default) with random-token prompts of 32-512 tokens and outputs of
32-256 tokens (ignore_eos), greedy, on the default model (SmolLM2-135M-Instruct GGUF).
transformers runs at each batch size and dtype asked for (float32 and bfloat16 at 8, 16, 32),
on dense weights (the GGUF dequantized by transformers once, saved to ~/.cache/quire/hf-dense),
left-padded, requests sorted by length so that padding wastes as little as possible (its best
case); only the tokens each request asked for count. With --llama-server, llama.cpp's server
(16 slots, -np 16 -c 16384) gets the same requests, all at once, through its /completion API.

    python benchmarks/throughput.py
    python benchmarks/throughput.py --skip-hf                         # Quire only
    python benchmarks/throughput.py --llama-server /tmp/llamabuild/bin/llama-server
    python benchmarks/throughput.py --quick
    python benchmarks/throughput.py --device cuda --model DIR   # a GPU, a model folder

With --model, Quire and transformers both load that folder (transformers as it is stored,
in each --hf-dtypes); --device cuda runs both engines on the GPU (GPU machines here cannot
take the GGUF along: benchmarks/cuda_engine.py --save-model writes a random-weight folder in
SmolLM2-135M's shape, and this workload is random tokens with ignore_eos, so weights do not
change the work).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import resource
import subprocess
import time
import urllib.request

from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars
from processes import free_port, stop, wait_ready


def make_requests(n: int, seed: int, vocab: int = 49152):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))]
        reqs.append((prompt, rng.randint(32, 256)))
    return reqs


def run_quire(reqs, args) -> float:
    from quire import LLM, SamplingParams
    from quire.config import EngineArgs
    kw = {k: v for k, v in (("model", args.model), ("device", args.device),
                            ("dtype", args.dtype), ("max_num_seqs", args.max_num_seqs),
                            ("max_num_batched_tokens", args.max_num_batched_tokens),
                            ("num_threads", args.num_threads),
                            ("quantization", args.quantization)) if v is not None}
    if "quantization" in kw and "quantization" not in EngineArgs.field_names():
        print(f"--quantization {kw.pop('quantization')} ignored: this Quire has no such option")
    llm = LLM(**kw)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    # warm-up; on CUDA the whole workload once, so that Triton's compiles (once per kernel
    # shape, then cached on disk) fall outside the timed run
    warm = len(reqs) if args.device and args.device.startswith("cuda") else 4
    llm.generate([p for p, _ in reqs[:warm]], params[:warm], use_tqdm=False)
    start = time.perf_counter()
    with StealMeter() as steal:
        outs = llm.generate([p for p, _ in reqs], params, use_tqdm=not args.quiet)
        synchronize(args.device)
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == sum(m for _, m in reqs)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    e = llm.engine
    quant = getattr(e.args, "quantization", None)
    print(f"quire ({str(e.dtype).removeprefix('torch.')}"
          f"{', quantization ' + str(quant) if quant else ''}, attention {e.attention_backend}, "
          f"max_num_seqs {e.args.max_num_seqs}, max_num_batched_tokens "
          f"{e.args.max_num_batched_tokens}): {len(reqs)} requests in {wall:.1f} s, "
          f"{generated / wall:.1f} generated tok/s, {(generated + prompt_tokens) / wall:.1f} "
          f"total tok/s, TTFT p50 {ttft[len(ttft) // 2]:.2f} s, preemptions "
          f"{sum(e.scheduler.num_preemptions.values())}, {steal}")
    return generated / wall


def synchronize(device: str | None) -> None:
    if device and device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def dense_folder() -> str:
    """The default GGUF dequantized by transformers itself, saved once as a safetensors folder:
    transformers then runs plain dense Linear layers (its best case), and the weights are its
    own reading of the file, not Quire's."""
    import torch
    from transformers import AutoModelForCausalLM

    from quire.models.loader import default_model_path
    gguf = default_model_path()
    folder = os.path.join(os.path.expanduser("~/.cache/quire/hf-dense"),
                          f"{os.path.basename(gguf).removesuffix('.gguf')}-{os.path.getsize(gguf)}")
    if not os.path.exists(os.path.join(folder, ".complete")):
        src, name = os.path.split(gguf)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        # save_pretrained refuses a model read from GGUF: write the (dense) tensors and a
        # config without the GGUF quantization note ourselves
        from safetensors.torch import save_file
        os.makedirs(folder, exist_ok=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(folder)
        open(os.path.join(folder, ".complete"), "w").close()
    return folder


def run_hf(reqs, batch_size: int, dtype: str, limit: int | None, model_dir: str | None = None,
           device: str | None = None) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    device = device or "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir or dense_folder(),
                                                 dtype=getattr(torch, dtype)).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    order = sorted(reqs, key=lambda r: len(r[0]) + r[1])
    if limit and limit < len(order):  # an evenly spaced subset: representative lengths
        order = [order[i * len(order) // limit] for i in range(limit)]
    with torch.inference_mode():  # warm-up: first calls pick kernels (and on CUDA, load them)
        model.generate(torch.tensor([order[0][0][:8]], device=device), do_sample=False,
                       max_new_tokens=2, pad_token_id=0)
    synchronize(device)
    generated, start = 0, time.perf_counter()
    steal = StealMeter().__enter__()
    with torch.inference_mode():
        for i in range(0, len(order), batch_size):
            batch = order[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch],
                                device=device)
            new = max(m for _, m in batch)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=0)
            generated += sum(m for _, m in batch)
    synchronize(device)
    wall = time.perf_counter() - start
    steal.__exit__()
    print(f"transformers ({dtype}, batch {batch_size}): {len(order)} requests in {wall:.1f} s, "
          f"{generated / wall:.1f} generated tok/s, {steal}")
    del model
    return generated / wall


def run_llama_server(reqs, binary: str, threads: int, slots: int, context: int) -> float:
    """llama-server on the same GGUF, all requests at once (it serves `slots` at a time)."""
    from quire.models.loader import default_model_path
    port = free_port()
    cmd = [binary, "-m", default_model_path(), "-t", str(threads), "-np", str(slots),
           "-c", str(context), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)

        def one(req) -> int:
            prompt, max_tokens = req
            body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True,
                    "temperature": 0, "cache_prompt": False}
            r = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                       {"Content-Type": "application/json"})
            with urllib.request.urlopen(r, timeout=3600) as resp:
                return int(json.loads(resp.read())["tokens_predicted"])

        one(([1, 2, 3], 4))  # warm-up
        start = time.perf_counter()
        with StealMeter() as steal, concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
            generated = sum(pool.map(one, reqs))
        wall = time.perf_counter() - start
    finally:
        stop(proc)
    print(f"llama-server ({threads} threads, -np {slots} -c {context}): {len(reqs)} requests "
          f"in {wall:.1f} s, {generated / wall:.1f} generated tok/s, {steal}")
    return generated / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None,
                    help="a model folder for both engines (default: the default GGUF, "
                         "transformers on its dequantized copy)")
    ap.add_argument("--device", default=None, help="cpu (default) or cuda, for both engines")
    ap.add_argument("--dtype", default=None, help="Quire's dtype (default: auto)")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--num-threads", type=int, default=None,
                    help="torch threads (default: the CPU quota, as Quire picks)")
    ap.add_argument("--quantization", default=None,
                    help="Quire's --quantization, where it has the option")
    ap.add_argument("--hf-batch-sizes", default="8,16,32")
    ap.add_argument("--hf-dtypes", default="float32,bfloat16")
    ap.add_argument("--hf-limit", type=int, default=None,
                    help="time transformers on an evenly spaced subset of this many requests "
                         "(its tok/s still compares; the full set takes hours)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="also run llama-server (e.g. /tmp/llamabuild/bin/llama-server)")
    ap.add_argument("--llama-slots", type=int, default=16)
    ap.add_argument("--llama-context", type=int, default=16384)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 8 requests, transformers float32 at batch 8 only")
    add_plot_flag(ap, "throughput")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.hf_batch_sizes, args.hf_dtypes = 8, "8", "float32"
    from quire.cpu_threads import detect_quota
    threads = args.num_threads or detect_quota().cpus
    print(describe_machine(threads))
    if args.device and args.device.startswith("cuda"):
        import torch
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    vocab = 49152  # SmolLM2's
    if args.model:
        with open(os.path.join(args.model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
    reqs = make_requests(args.num_requests, args.seed, vocab)
    print(f"{len(reqs)} requests: prompts {sum(len(p) for p, _ in reqs)} tokens, outputs "
          f"{sum(m for _, m in reqs)} tokens")
    results = {"Quire": run_quire(reqs, args)}
    quire = results["Quire"]
    print(f"peak RSS after Quire: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if args.llama_server:
        llama = run_llama_server(reqs, args.llama_server, threads, args.llama_slots,
                                 args.llama_context)
        results[f"llama-server\n-np {args.llama_slots}"] = llama
        print(f"Quire / llama-server = {quire / llama:.2f}x")
    if not args.skip_hf:
        import torch
        torch.set_num_threads(threads)  # the same threads for transformers
        hf = {f"transformers\n{d}, batch {b}": run_hf(reqs, b, d, args.hf_limit, args.model,
                                                        args.device)
              for d in args.hf_dtypes.split(",") for b in map(int, args.hf_batch_sizes.split(","))}
        best = max(hf, key=hf.get)
        print(f"best transformers: {hf[best]:.1f} tok/s ({best.split(chr(10))[1]}); "
              f"Quire / best = {quire / hf[best]:.2f}x")
        results.update(hf)
    if args.plot:
        grouped_bars(args.plot, f"Offline throughput, {len(reqs)} requests", "generated tok/s",
                     list(results), {"generated tok/s": list(results.values())},
                     caption=machine_caption(threads))

if __name__ == "__main__":
    main()
