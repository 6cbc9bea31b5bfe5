"""Image + text requests: Quire beside transformers' generate on the same LLaVA-shaped model,
in one run, and the encoder cache's effect on repeated images.

The model has LLaVA-1.5's layout at a size this CPU runs: a CLIP ViT-B/16 tower (224 px,
196 image tokens per image) and a SmolLM2-135M-shaped Llama decoder, random weights (no
hub here; speed does not depend on the values), saved with transformers' own
save_pretrained and processor. Every request is one image + a short question.

    TTFT          one request alone (its image new: the encoder runs), median of 3
    requests/s    N requests with distinct images, each generating --output-len tokens
                  (ignore_eos); transformers: batched generate, left-padded, batch 8 and 16
    encoder cache the same N requests with one image repeated (the text before it differs,
                  so no KV block is shared: only the encoder is skipped)

    python benchmarks/vision.py
    python benchmarks/vision.py --num-requests 32 --plot
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import numpy as np
from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars

IMAGE_TOKEN = "<image>"


def build_model(path: str, quick: bool) -> str:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from quire.models.loader import load_tokenizer, materialize, resolve_model
    tok = copy.deepcopy(load_tokenizer(materialize(resolve_model(None)), None))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    size, patch = (56, 14) if quick else (224, 16)
    vision = (CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, image_size=size, patch_size=patch)
              if quick else
              CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                               num_attention_heads=12, image_size=size, patch_size=patch))
    text = (LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
            if quick else
            LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536,
                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        max_position_embeddings=8192, rope_theta=100000.0,
                        tie_word_embeddings=True))
    text.bos_token_id, text.eos_token_id = tok.bos_token_id, tok.eos_token_id
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         architectures=["LlavaForConditionalGeneration"])
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": size},
                                           crop_size={"height": size, "width": size}),
        tokenizer=tok, patch_size=patch, vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN, num_additional_image_tokens=1)
    processor.save_pretrained(path)
    return path


def image(seed: int):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8), "RGB")


def prompts(n: int, same_image: bool) -> list[dict]:
    return [{"prompt": f"USER: request {i}. {IMAGE_TOKEN}\nDescribe the picture. ASSISTANT:",
             "multi_modal_data": {"image": image(1000 if same_image else 1000 + i)}}
            for i in range(n)]


def run_quire(path: str, args) -> dict:
    from quire import LLM, SamplingParams
    llm = LLM(path, dtype="float32", num_threads=args.threads, kv_cache_memory=1 << 30)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts(2, False), params, use_tqdm=False)  # warm-up (images 1000, 1001)
        first = SamplingParams(temperature=0, max_tokens=1)
        ttfts = []
        for seed in (7, 8, 9):
            p = {"prompt": f"USER: {IMAGE_TOKEN}\nWhat is it? ASSISTANT:",
                 "multi_modal_data": {"image": image(seed)}}
            start = time.perf_counter()
            llm.generate([p], first, use_tqdm=False)
            ttfts.append(time.perf_counter() - start)
        out = {"ttft": statistics.median(ttfts)}
        mm = llm.engine.executor.multimodal
        for key, same in (("distinct", False), ("repeated", True)):
            batch = prompts(args.num_requests, same)
            if not same:  # images not seen before (the warm-up's are 1000 and 1001)
                for i, p in enumerate(batch):
                    p["multi_modal_data"]["image"] = image(5000 + i)
            encoded, seconds = mm.images_encoded, mm.encoder_seconds
            start = time.perf_counter()
            with StealMeter() as steal:
                llm.generate(batch, params, use_tqdm=False)
            wall = time.perf_counter() - start
            out[key] = {"rps": len(batch) / wall, "wall": wall,
                        "images": mm.images_encoded - encoded,
                        "encoder_s": mm.encoder_seconds - seconds, "steal": str(steal)}
        return out
    finally:
        llm.engine.shutdown()


def run_transformers(path: str, args) -> dict:
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    torch.set_num_threads(args.threads)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"

    def generate(batch: list[dict], new_tokens: int) -> None:
        inputs = processor(text=[p["prompt"] for p in batch],
                           images=[p["multi_modal_data"]["image"] for p in batch],
                           return_tensors="pt", padding=True)
        with torch.no_grad():
            model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=0)

    generate(prompts(2, False), 2)  # warm-up
    ttfts = []
    for seed in (7, 8, 9):
        p = {"prompt": f"USER: {IMAGE_TOKEN}\nWhat is it? ASSISTANT:",
             "multi_modal_data": {"image": image(seed)}}
        start = time.perf_counter()
        generate([p], 1)
        ttfts.append(time.perf_counter() - start)
    out = {"ttft": statistics.median(ttfts)}
    batch = prompts(args.num_requests, False)
    for size in args.hf_batch_sizes:
        start = time.perf_counter()
        with StealMeter() as steal:
            for i in range(0, len(batch), size):
                generate(batch[i:i + size], args.output_len)
        wall = time.perf_counter() - start
        out[f"batch {size}"] = {"rps": len(batch) / wall, "wall": wall, "steal": str(steal)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--quick", action="store_true", help="a tiny model (a smoke run)")
    add_plot_flag(p, "vision")
    args = p.parse_args()
    print(describe_machine(args.threads))
    with tempfile.TemporaryDirectory(prefix="quire-vision-") as tmp:
        path = build_model(os.path.join(tmp, "llava"), args.quick)
        shape = "tiny" if args.quick else ("CLIP ViT-B/16 224 px (196 image tokens) + "
                                           "SmolLM2-135M-shaped decoder")
        print(f"LLaVA-shaped: {shape}, float32; "
              f"{args.num_requests} requests x (1 image + ~20 text tokens) -> "
              f"{args.output_len} tokens")
        hf = run_transformers(path, args)
        quire = run_quire(path, args)
    best = max((k for k in hf if k.startswith("batch")), key=lambda k: hf[k]["rps"])
    print(f"{'':<34} {'TTFT':>8} {'requests/s':>11}")
    print(f"{'transformers generate, ' + best:<34} {hf['ttft'] * 1000:7.0f}ms "
          f"{hf[best]['rps']:11.2f}   | {hf[best]['steal']}")
    for k in hf:
        if k.startswith("batch") and k != best:
            print(f"{'transformers generate, ' + k:<34} {'':>8} {hf[k]['rps']:11.2f}")
    d, r = quire["distinct"], quire["repeated"]
    print(f"{'Quire, distinct images':<34} {quire['ttft'] * 1000:7.0f}ms {d['rps']:11.2f}   "
          f"| {d['images']} images encoded in {d['encoder_s']:.2f} s | {d['steal']}")
    print(f"{'Quire, one image repeated':<34} {'':>8} {r['rps']:11.2f}   "
          f"| {r['images']} images encoded in {r['encoder_s']:.2f} s (encoder cache) | "
          f"{r['steal']}")
    print(f"Quire / transformers: {d['rps'] / hf[best]['rps']:.2f}x requests/s, TTFT "
          f"{hf['ttft'] / quire['ttft']:.2f}x lower; repeated image: {r['rps'] / d['rps']:.2f}x "
          f"the distinct-image rate")
    if args.plot:
        grouped_bars(args.plot, "Image + text requests (LLaVA-shaped, float32)", "requests/s",
                     ["requests/s"],
                     {f"transformers ({best})": [hf[best]["rps"]],
                      "Quire, distinct images": [d["rps"]],
                      "Quire, repeated image": [r["rps"]]}, caption=machine_caption(args.threads))


if __name__ == "__main__":
    main()
