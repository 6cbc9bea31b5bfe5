"""A tiny random Gemma 3 (Gemma3ForConditionalGeneration) saved as transformers saves one:
config, safetensors, and a Gemma3Processor with the SmolLM2 tokenizer plus Gemma 3's
begin-of-image, end-of-image and image soft tokens. Its text decoder mixes sliding and global
layers with a window (8) shorter than an image's run of soft tokens (16), so a sliding
layer's window matters inside every image.

transformers' greedy output on the processor's own inputs (token_type_ids included, which
turn on its bidirectional attention over each image) is the oracle of the Gemma 3 tests.
"""

from __future__ import annotations

import copy
import json
import os

import torch

from runtime_helpers import smollm2_tokenizer

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
IMAGE_SIZE = 64       # pixels per side after the processor's resize
PATCH = 8             # 8 x 8 patches, average-pooled 2 x 2 by the projector ...
TOKENS_PER_IMAGE = 16  # ... into 16 soft tokens per image
SLIDING_WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}" + BOI + "{% else %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma3_tokenizer(folder: str):
    """The SmolLM2 tokenizer with Gemma 3's three image tokens, named as Gemma 3's tokenizer
    names them (boi_token, eoi_token, image_token: Gemma3Processor reads all three), saved
    into `folder` and read back."""
    from transformers import AutoTokenizer
    tok = copy.deepcopy(smollm2_tokenizer())  # the shared one stays as it is
    tok.add_special_tokens({"additional_special_tokens": [BOI, EOI, SOFT]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(boi_token=BOI, eoi_token=EOI, image_token=SOFT)  # as Gemma 3's file has
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return AutoTokenizer.from_pretrained(folder)


def gemma3_config(tok, **text_overrides):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH)
    text = Gemma3TextConfig(**{
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": len(LAYER_TYPES), "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
        "max_position_embeddings": 512, "sliding_window": SLIDING_WINDOW,
        "layer_types": LAYER_TYPES, "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id, "pad_token_id": 0,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        **text_overrides})
    return Gemma3Config(vision_config=vision, text_config=text,
                        mm_tokens_per_image=TOKENS_PER_IMAGE,
                        boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                        image_token_index=tok.image_token_id,
                        architectures=["Gemma3ForConditionalGeneration"])


def save_tiny_gemma3(path: str, seed: int = 0) -> str:
    from transformers import (
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )
    os.makedirs(path, exist_ok=True)
    tok = gemma3_tokenizer(path)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(gemma3_config(tok)).to(torch.float32)
    with torch.no_grad():  # norms start at the identity and biases at zero: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("mm_input_projection_weight"):  # features that vary by image
                p.normal_(0, p.shape[0] ** -0.5)
    model.save_pretrained(path)
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE,
                                                    "width": IMAGE_SIZE})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok,
                                chat_template=CHAT_TEMPLATE,
                                image_seq_length=TOKENS_PER_IMAGE)
    processor.save_pretrained(path)
    return path


def hf_gemma3(path: str):
    from transformers import Gemma3ForConditionalGeneration
    return Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
