"""What int8 activations would buy, and cost: the road llama.cpp takes (Q8_1 activations
against Q4_1 weights), measured before Quire takes it.

Speed: a probe kernel (int8_activations.cpp: vpmaddubsw on u8 int4 weights x s8 activations,
group 32, built here for this CPU) beside Quire's own int4 kernel on the same weights, at
SmolLM2's linear shapes and a prefill's rows, best of 7 calls, alternated, in one process.
Both multiply the same Q4_1-style weights; the probe also pays nothing for quantizing x
(timed apart) or for repacking the weights (done once, ahead).

Cost: transformers on Quire's dequantized GGUF weights, greedy, with float32 activations and
with every Linear's input rounded to int8 per row and group of 32 (absmax scale, as Q8_1):
how many sequences stay identical end to end, and the mean first divergence (fp8_kv.py's
measure). Quire's own kernels keep float32 activations: 16/16 against transformers
(benchmarks/quant_parity.py).

    python benchmarks/int8_activations.py
    python benchmarks/int8_activations.py --part speed --rows 512
    python benchmarks/int8_activations.py --part agreement --num-prompts 16 --max-tokens 32
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "quant"))
sys.path.insert(0, str(HERE))

from machine import describe_machine  # noqa: E402

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576)}  # (N, K)


def build_probe() -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "int8_probe.so"
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17",
                    str(HERE / "int8_activations.cpp"), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.probe_int8_gemm.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 3
    return lib


def quantize_rows(x, group: int = 32):
    """Q8_1-style: int8 per row and group (absmax / 127), the scales, and each group's sum of
    the dequantized values (the min term's factor)."""
    import torch
    m, k = x.shape
    g = x.view(m, k // group, group)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-30)
    q = torch.round(g / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    sums = (q.float() * scale[..., None]).sum(-1)
    return q.view(m, k), scale.contiguous(), sums.contiguous()


def speed(rows: int, rounds: int) -> None:
    import torch

    lib = build_probe()
    torch.manual_seed(0)
    print(f"{rows} rows of x, int4 weights in groups of 32 (scale and min), "
          f"{torch.get_num_threads()} threads")
    for name, (n, k) in SHAPES.items():
        one_shape(lib, name, n, k, rows, rounds)


def one_shape(lib: ctypes.CDLL, name: str, n: int, k: int, rows: int, rounds: int) -> None:
    import torch

    from quire.native import quant_matmul as qm
    groups = k // 32
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    s = (torch.rand(n, groups) * 0.01 + 0.001).half().float()
    mn = (-(torch.rand(n, groups) * 0.05)).half().float()
    dense = q.float() * s.repeat_interleave(32, 1) + mn.repeat_interleave(32, 1)
    # Quire's form: (q - 8) s + zeros, zeros = min + 8 s: the same weights
    packed = qm.pack_int4((q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), s, mn + 8 * s, 32)
    w = q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    sw = s.view(n // 16, 16, groups).permute(0, 2, 1).contiguous()
    mw = mn.view(n // 16, 16, groups).permute(0, 2, 1).contiguous()
    x = torch.randn(rows, k)
    xq, xd, xs = quantize_rows(x)
    c = torch.empty(rows, n)

    def probe():
        lib.probe_int8_gemm(xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), w.data_ptr(),
                            sw.data_ptr(), mw.data_ptr(), c.data_ptr(), rows, k, n)

    want = x @ dense.T
    probe()
    err_probe = ((c - want).abs().max() / want.abs().max()).item()
    err_quire = ((qm.int4_linear(x, packed) - want).abs().max() / want.abs().max()).item()
    best = {"quire (float32 x)": [], "probe (int8 x)": [], "quantizing x": []}
    calls = {"quire (float32 x)": lambda: qm.int4_linear(x, packed), "probe (int8 x)": probe,
             "quantizing x": lambda: quantize_rows(x)}
    for _ in range(rounds):
        for label, fn in calls.items():
            times = []
            for _ in range(7):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            best[label].append(min(times))
    flop = 2 * rows * n * k
    med = {label: sorted(v)[len(v) // 2] for label, v in best.items()}
    print(f"  {name} [{n} x {k}]: " + ", ".join(
        f"{label} {t * 1e3:.2f} ms" + (f" ({flop / t / 1e9:.0f} GFLOP/s)"
                                      if "quantizing" not in label else "")
        for label, t in med.items())
        + f"; probe / quire {med['quire (float32 x)'] / med['probe (int8 x)']:.2f}x; "
        f"max error / max |y|: quire {err_quire:.1e}, probe {err_probe:.1e}")


def agreement(num_prompts: int, max_tokens: int) -> None:
    import torch
    from fp8_kv import prompts
    from transformers import AutoModelForCausalLM

    from quire import LLM
    from quire.models.loader import default_model_path

    from quant_helpers import agreement as compare
    from quant_helpers import dequantized_state_dict, hf_with_weights
    llm = LLM(dtype="float32", quantization="auto", kv_cache_memory=128 << 20)
    tok = llm.tokenizer
    ids = [tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False).input_ids for c in prompts(num_prompts, 0)]
    folder, name = os.path.split(default_model_path())
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf = hf_with_weights(hf, dequantized_state_dict(llm.engine.executor.model))
    del llm

    def generate() -> list[list[int]]:
        out = []
        with torch.no_grad():
            for p in ids:
                t = torch.tensor([p])
                o = hf.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                                max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                pad_token_id=0)
                out.append(o[0, len(p):].tolist())
        return out

    def int8_input(module, args):
        x = args[0]
        q, scale, _ = quantize_rows(x.reshape(-1, x.shape[-1]))
        k = x.shape[-1]
        deq = q.float().view(-1, k // 32, 32) * scale[..., None]
        return (deq.view(x.shape),)

    reference = generate()
    for m in hf.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(int8_input)
    identical, first = compare(reference, generate())
    print(f"SmolLM2-135M GGUF weights (dequantized), {num_prompts} chat prompts, {max_tokens} "
          f"greedy tokens: int8 activations (per row and group of 32) against float32 "
          f"activations: {identical}/{num_prompts} sequences identical, mean first divergence "
          f"{first:.1f}/{max_tokens}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["speed", "agreement", "both"], default="both")
    ap.add_argument("--rows", type=int, default=512, help="rows of x (a prefill chunk's tokens)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    print(describe_machine())
    if args.part in ("speed", "both"):
        speed(args.rows, args.rounds)
    if args.part in ("agreement", "both"):
        agreement(args.num_prompts, args.max_tokens)


if __name__ == "__main__":
    main()
