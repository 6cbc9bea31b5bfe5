"""Quantized SmolLM2 against transformers run on the very weights Quire multiplies by: for
each --quantization (none, int8, int4, auto = the GGUF's own Q4_1/Q8_0), Quire's greedy
output beside transformers' on Quire's dequantized weights written back into its model.

Both sides then hold the same fp32 weights; what differs is only the kernels' order of
summation (and, for int8/int4 quantized on load, whichever kernel ran), so the figures say
how often that flips a greedy token. Agreement as in fp8_kv.py: sequences identical end to
end and the mean position of the first divergence. With `--activation-quantization int8` the
int4 weights' kernels round x to int8 (the engine's option): what that costs in agreement.

    python benchmarks/quant_parity.py --num-prompts 16 --max-tokens 32
    python benchmarks/quant_parity.py --quantizations auto --activation-quantization none int8
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "quant"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_kv import prompts  # noqa: E402

from quant_helpers import agreement, dequantized_state_dict, hf_with_weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4", "auto"])
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--activation-quantization", nargs="+", default=["none"],
                    choices=["none", "int8"])
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from quire import LLM, SamplingParams
    from quire.models.loader import default_model_path
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    chats = prompts(args.num_prompts, args.seed)
    folder, name = os.path.split(default_model_path())
    print(f"SmolLM2-135M GGUF, {args.num_prompts} chat prompts, {args.max_tokens} greedy "
          f"tokens, float32 model")
    for q, act in [(q, a) for q in args.quantizations for a in args.activation_quantization]:
        llm = LLM(dtype="float32", quantization=q, quantization_group_size=args.group_size,
                  activation_quantization=act, kv_cache_memory=128 << 20)
        tok = llm.tokenizer
        ids = [tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False).input_ids for c in chats]
        got = [o.outputs[0].token_ids for o in
               llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)]
        kernel = llm.engine.executor.model.layers[0].qkv_proj
        kernel = getattr(getattr(kernel, "quant_kernel", None), "name", "float")
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                  dtype=torch.float32).eval()
        hf = hf_with_weights(hf, dequantized_state_dict(llm.engine.executor.model))
        want = []
        with torch.no_grad():
            for p in ids:
                t = torch.tensor([p])
                out = hf.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                                  max_new_tokens=args.max_tokens, pad_token_id=0,
                                  min_new_tokens=args.max_tokens)
                want.append(out[0, len(p):].tolist())
        identical, first = agreement(want, got)
        print(f"{q:>5} (kernel {kernel}, activations {act}): {identical}/{len(ids)} "
              f"sequences identical, "
              f"mean first divergence {first:.1f}/{args.max_tokens}")
        del llm, hf


if __name__ == "__main__":
    main()
