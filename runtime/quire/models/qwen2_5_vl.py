"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): transformers' vision tower (patch embed,
window and full attention blocks, the 2 x 2 patch merger) before the Qwen2 decoder, whose
rotary takes M-RoPE positions: (temporal, height, width) per token, [3, T].

The tower is transformers' own module (Qwen2_5_VisionTransformerPretrainedModel), so the
image features are its to the bit; the decoder is our Llama body (Qwen2's q/k/v biases) with
`rope.MRotaryEmbedding`. The positions come from the processor step
(`quire.multimodal.mrope`); the runner hands the model [3, T] for prompt chunks, or [T]
where all three are equal. Checkpoint names come in two spellings; both map here:
    model.language_model.X | model.X        -> the decoder's X
    lm_head.X                               -> lm_head.X
    model.visual.X | visual.X               -> the tower
"""

from __future__ import annotations

import torch

from quire.models.decoder import GLOBAL_ROPE
from quire.models.llama import LlamaForCausalLM
from quire.models.mm_weights import load_module, split_checkpoint
from quire.models.rope import MRotaryEmbedding

_VISION = ("model.visual.", "visual.")
_HEAD = ("lm_head.",)
_TEXT = ("model.language_model.", "model.")
DEFAULT_MROPE_SECTION = [16, 24, 24]  # transformers' default when the config names none


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg, backend_factory, max_model_len, dtype, device,
                 quant_config=None) -> None:
        super().__init__(cfg, backend_factory, max_model_len, dtype, device, quant_config)
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )
        mm = self.mm_config = cfg.multimodal_hf
        self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(
            mm.vision_config, dtype=dtype).to(device).eval()
        self.merge_size = mm.vision_config.spatial_merge_size
        for p in self.visual.parameters():
            p.loads_itself = True  # loaded here, not by the decoder's shared loader

    def make_ropes(self, max_model_len, dtype, device):
        cfg = self.cfg
        rope = dict(getattr(cfg.hf, "rope_parameters", None) or {})
        return {GLOBAL_ROPE: MRotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
            max_model_len, dtype, device, hf_config=cfg.hf,
            mrope_section=rope.get("mrope_section") or DEFAULT_MROPE_SECTION)}

    def encode_images(self, inputs: list[dict]) -> list[torch.Tensor]:
        """Per image, its [t * h * w / merge^2, hidden] merged features as transformers'
        get_image_features makes them: one tower call for the step's images (each image
        attends within itself: the tower's sequence boundaries come from the grids)."""
        dtype = next(self.visual.parameters()).dtype
        pixels = torch.cat([x["pixel_values"] for x in inputs]).to(dtype)
        grid = torch.cat([x["image_grid_thw"] for x in inputs])
        merged = self.visual(pixels, grid_thw=grid).pooler_output
        return list(torch.split(merged, (grid.prod(-1) // self.merge_size**2).tolist()))

    def load_weights(self, weights) -> None:
        decoder, parts = split_checkpoint(weights, {"vision": _VISION}, _HEAD, _TEXT)
        super().load_weights(decoder)
        load_module(self.visual, parts["vision"], "vision tower")
