"""A tiny random LLaVA saved as transformers saves one (config, safetensors, processor with
the SmolLM2 tokenizer plus `<image>`), small random images, and transformers' greedy output
on the processor's own inputs: the oracle of the multimodal parity tests."""

from __future__ import annotations

import copy

import numpy as np
import torch

from runtime_helpers import smollm2_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56      # pixels per side after the processor's resize and crop
PATCH = 14           # 4 x 4 patches: 16 image tokens per image (CLS dropped)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llava_config(image_size: int = IMAGE_SIZE):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    tok = smollm2_tokenizer()
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=image_size, patch_size=PATCH,
                              projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok) + 1, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=len(tok),
                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                       architectures=["LlavaForConditionalGeneration"])


def save_tiny_llava(path: str, seed: int = 0) -> str:
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration, LlavaProcessor
    torch.manual_seed(seed)
    config = llava_config()
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # norms start at the identity and biases at zero: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
            if "multi_modal_projector" in name and name.endswith("weight"):
                p.normal_(0, p.shape[1] ** -0.5)  # features that vary with the image
    model.save_pretrained(path)
    tok = copy.deepcopy(smollm2_tokenizer())  # the shared one stays as it is
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = CHAT_TEMPLATE
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok,
                               patch_size=PATCH, vision_feature_select_strategy="default",
                               chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN,
                               num_additional_image_tokens=1)
    processor.save_pretrained(path)
    return path


def random_image(seed: int, size=(40, 32)):
    """Random colour blocks (a 4 x 4 grid) over a little noise: noise alone looks the same
    to a random vision tower, blocks of colour don't."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    grid = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8), "RGB")
    blocks = np.asarray(grid.resize(size, Image.NEAREST), dtype=np.int16)
    noise = rng.integers(-20, 21, blocks.shape)
    return Image.fromarray(np.clip(blocks + noise, 0, 255).astype(np.uint8), "RGB")


def hf_llava(path: str):
    from transformers import LlavaForConditionalGeneration
    return LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy_mm(model, processor, prompt: str, images, max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on the processor's own inputs for one prompt."""
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=0)
    return gen[0, inputs["input_ids"].shape[1]:].tolist()
