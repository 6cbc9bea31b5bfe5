"""GPU benchmark of the Triton paged-attention kernels (needs CUDA; nothing to measure on a
CPU, where the kernels only run in Triton's interpreter for tests).

For each shape it prints time per call and the figure to judge it by:
  decode   - KV bytes read per second, against the GPU's peak memory bandwidth (decode is
             memory-bound: a good paged kernel reads the cache at 70-85% of peak);
  prefill  - attention TFLOP/s, against torch's scaled_dot_product_attention (FlashAttention
             on CUDA) doing the same causal math on contiguous, unpaged tensors;
  write    - bytes moved per second by the cache-write kernel.
The torch reference backend runs on the same batches for comparison.

    python benchmarks/attention_kernels.py                        # Llama-3-8B-like, bf16
    python benchmarks/attention_kernels.py --heads 32 --kv-heads 32 --head-dim 128 \
        --dtype float16 --kv-dtype fp8_e4m3 --block-size 16
"""

from __future__ import annotations

import argparse
import sys

import torch


def paged_step(seqs, args, device):
    """A cache holding every sequence's context in shuffled blocks, the step's q/k/v, and its
    metadata. seqs: (context length, query length), decodes first."""
    from quire.attention.base import AttentionMetadata
    dtype = getattr(torch, args.dtype)
    kv_dtype = {"auto": dtype, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}[args.kv_dtype]
    bs, hkv, d = args.block_size, args.kv_heads, args.head_dim
    need = [-(-ctx // bs) for ctx, _ in seqs]
    perm = torch.randperm(sum(need), device=device).to(torch.int32)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[start:start + n]
        start += n
    caches = [torch.randn(sum(need), bs, hkv, d, device=device).to(kv_dtype) for _ in range(2)]
    qls = [ql for _, ql in seqs]
    t = sum(qls)
    q = torch.randn(t, args.heads, d, device=device, dtype=dtype)
    k, v = (torch.randn(t, hkv, d, device=device, dtype=dtype) for _ in range(2))
    slots = []
    for i, (ctx, ql) in enumerate(seqs):
        pos = torch.arange(ctx - ql, ctx, device=device)
        slots.append(tables[i, pos // bs].long() * bs + pos % bs)
    qsl = [0]
    for ql in qls:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        num_decodes=sum(ql == 1 for ql in qls),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=device),
        block_tables=tables, slot_mapping=torch.cat(slots), max_query_len=max(qls),
        max_seq_len=max(c for c, _ in seqs), block_size=bs, query_start_loc_cpu=qsl,
        seq_lens_cpu=[c for c, _ in seqs])
    return q, k, v, caches, meta


def kv_itemsize(args) -> int:
    return getattr(torch, args.dtype).itemsize if args.kv_dtype == "auto" else 1


def time_backend(backend, q, k, v, caches, meta) -> float:
    """Seconds per forward, or nan if the backend can't run this case (the torch backend's
    index_copy_ may lack an fp8 kernel)."""
    from triton.testing import do_bench
    meta.backend_state.clear()
    backend.prepare(meta)   # once per step, shared by every layer: not timed
    try:
        return do_bench(lambda: backend.forward(q, k, v, *caches, meta)) * 1e-3
    except (RuntimeError, NotImplementedError) as e:
        if backend.name == "triton":
            raise
        print(f"  ({backend.name} backend: {str(e).splitlines()[0]})")
        return float("nan")


def backends(args):
    from quire.attention.torch_backend import TorchAttentionBackend
    from quire.attention.triton_backend import TritonAttentionBackend
    scale = args.head_dim ** -0.5
    return {name: cls(args.heads, args.kv_heads, args.head_dim, scale, args.sliding_window)
            for name, cls in (("triton", TritonAttentionBackend), ("torch", TorchAttentionBackend))}


def bench_decode(args, device):
    print("\ndecode  (GB/s of K/V read; compare with the GPU's peak memory bandwidth)")
    print(f"{'batch':>6} {'context':>8} {'triton ms':>10} {'GB/s':>8} {'torch ms':>10}")
    for batch in args.batches:
        for ctx in args.contexts:
            kv_bytes = 2 * batch * ctx * args.kv_heads * args.head_dim * kv_itemsize(args)
            if 3 * kv_bytes > torch.cuda.mem_get_info(device)[0]:   # the torch side copies K/V
                print(f"{batch:>6} {ctx:>8}   skipped: {kv_bytes / 2**30:.1f} GiB of K/V")
                continue
            q, k, v, caches, meta = paged_step([(ctx, 1)] * batch, args, device)
            times = {n: time_backend(b, q, k, v, caches, meta) for n, b in backends(args).items()}
            print(f"{batch:>6} {ctx:>8} {times['triton'] * 1e3:>10.3f} "
                  f"{kv_bytes / times['triton'] / 1e9:>8.0f} {times['torch'] * 1e3:>10.3f}")


def bench_prefill(args, device):
    import torch.nn.functional as F
    from triton.testing import do_bench
    print("\nprefill (TFLOP/s; compare with SDPA on contiguous tensors, the unpaged ceiling)")
    print(f"{'chunk':>6} {'prefix':>7} {'triton ms':>10} {'TFLOP/s':>8} {'SDPA TFLOP/s':>13} "
          f"{'torch ms':>10}")
    dtype = getattr(torch, args.dtype)
    for chunk in args.chunks:
        for prefix in (0, chunk):
            ctx = prefix + chunk
            q, k, v, caches, meta = paged_step([(ctx, chunk)], args, device)
            visible = chunk * prefix + chunk * (chunk + 1) / 2   # causal (query, key) pairs
            flops = 4 * args.heads * args.head_dim * visible
            times = {n: time_backend(b, q, k, v, caches, meta) for n, b in backends(args).items()}
            qd = torch.randn(1, args.heads, chunk, args.head_dim, device=device, dtype=dtype)
            kd = torch.randn(1, args.heads, ctx, args.head_dim, device=device, dtype=dtype)
            mask = None if prefix == 0 else (
                torch.arange(ctx, device=device)[None, :]
                <= torch.arange(prefix, ctx, device=device)[:, None])
            sdpa = do_bench(lambda: F.scaled_dot_product_attention(
                qd, kd, kd, attn_mask=mask, is_causal=prefix == 0)) * 1e-3
            print(f"{chunk:>6} {prefix:>7} {times['triton'] * 1e3:>10.3f} "
                  f"{flops / times['triton'] / 1e12:>8.1f} {flops / sdpa / 1e12:>13.1f} "
                  f"{times['torch'] * 1e3:>10.3f}")


def bench_write(args, device):
    from triton.testing import do_bench

    from quire.attention.triton_kernels.cache_write import write_kv_cache
    print("\ncache write (GB/s read + written)")
    for tokens in (1024, 8192):
        q, k, v, caches, meta = paged_step([(tokens, tokens)], args, device)
        moved = 2 * k.numel() * (k.element_size() + caches[0].element_size())
        t = do_bench(lambda: write_kv_cache(k, v, *caches, meta.slot_mapping)) * 1e-3
        print(f"{tokens:>6} tokens {t * 1e3:>8.3f} ms {moved / t / 1e9:>8.0f} GB/s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048, 8192])
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("attention_kernels.py benchmarks CUDA kernels and torch sees no CUDA device; "
              "nothing to measure here (on a CPU the kernels run only in Triton's interpreter, "
              "for tests). Run it on a GPU machine.", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(device)}; heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, {args.dtype}, KV {args.kv_dtype}, "
          f"block size {args.block_size}")
    bench_decode(args, device)
    bench_prefill(args, device)
    bench_write(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
