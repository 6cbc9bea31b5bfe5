"""A tiny random Qwen2.5-VL saved as transformers saves one (config, safetensors, processor
with the SmolLM2 tokenizer plus Qwen's vision tokens), and transformers' model on it: the
oracle of the Qwen2.5-VL parity tests.

The vision tower is small but runs both of its attention kinds: windows of 2 x 2 merged
tokens (window_size 56 over 14-pixel patches merged 2 x 2) in blocks 0 and 2, full attention
in blocks 1 and 3. The image processor keeps images between 4 and 64 merged tokens."""

from __future__ import annotations

import torch

from runtime_helpers import smollm2_tokenizer

IMAGE_PAD = "<|image_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
IMAGE = f"{VISION_START}{IMAGE_PAD}{VISION_END}"  # what a prompt writes per image
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}"
    "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen_vl_processor_class():
    """transformers 5.24's Qwen2.5-VL processor holds a video processor too, which needs
    torchvision; without torchvision the class is the engine's images-only one
    (quire.multimodal.processor.images_only), in the checkpoint as in the oracle."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.utils import is_torchvision_available

    from quire.multimodal.processor import images_only
    return Qwen2_5_VLProcessor if is_torchvision_available() else images_only(
        Qwen2_5_VLProcessor)


def qwen_vl_processor(path: str):
    """The oracle's processor, loaded as the engine loads it."""
    from quire.multimodal.processor import load_processor
    return load_processor(path)


def qwen_vl_tokenizer():
    tok = smollm2_tokenizer()  # a copy: the shared one stays as it is
    tok.add_special_tokens({"additional_special_tokens": [
        VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def qwen_vl_config(tok):
    from transformers import Qwen2_5_VLConfig
    ids = {t: tok.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VIDEO_PAD, VISION_START,
                                                     VISION_END)}
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=14, temporal_patch_size=2,
                  spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1, 3],
                  tokens_per_second=2)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]},  # head_dim 16: 8 frequencies
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text,
                            image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
                            vision_start_token_id=ids[VISION_START],
                            vision_end_token_id=ids[VISION_END], tie_word_embeddings=False,
                            architectures=["Qwen2_5_VLForConditionalGeneration"])


def save_tiny_qwen_vl(path: str, seed: int = 0) -> str:
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,  # the PIL one: no torchvision here
    )
    torch.manual_seed(seed)
    tok = qwen_vl_tokenizer()
    model = Qwen2_5_VLForConditionalGeneration(qwen_vl_config(tok)).to(torch.float32)
    with torch.no_grad():  # norms start at the identity and biases at zero: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
            if p.ndim == 2 and "patch_embed" not in name:  # outputs that vary with the input
                p.normal_(0, 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5)
    model.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                               patch_size=14, temporal_patch_size=2,
                                               merge_size=2)
    processor = qwen_vl_processor_class()(image_processor=image_processor, tokenizer=tok,
                                                  chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path


def hf_qwen_vl(path: str):
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
