"""LLaVA (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector, and the
Llama decoder, whose embeddings take the projected image features at the image placeholders.

The tower and the projector are transformers' own modules (CLIPVisionModel through
AutoModel, LlavaMultiModalProjector), so the image features are transformers' to the bit;
the decoder is our Llama body. Checkpoint names come in two spellings (transformers before
and after its 4.52 rename); both map here:
    language_model.model.X | model.language_model.X | language_model.X -> the decoder's X
    language_model.lm_head.X | lm_head.X                               -> lm_head.X
    vision_tower.X | model.vision_tower.X                              -> the tower
    multi_modal_projector.X | model.multi_modal_projector.X            -> the projector

The checkpoint is split and the tower and projector filled by mm_weights.py, which the other
vision-language families share.
"""

from __future__ import annotations

import copy

import torch

from quire.models.llama import LlamaForCausalLM
from quire.models.mm_weights import load_module, split_checkpoint

_VISION = ("model.vision_tower.", "vision_tower.")
_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")
_HEAD = ("language_model.lm_head.", "lm_head.")
_TEXT = ("model.language_model.", "language_model.model.", "language_model.")


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg, backend_factory, max_model_len, dtype, device,
                 quant_config=None) -> None:
        super().__init__(cfg, backend_factory, max_model_len, dtype, device, quant_config)
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
        mm = self.mm_config = cfg.multimodal_hf
        # hidden-state indices (0: the embeddings) of the layers the features come from, and
        # a tower of only the layers up to the last of them (LLaVA reads the penultimate
        # layer: the last one is never run, nor loaded, as vLLM does)
        vision = copy.deepcopy(mm.vision_config)
        total = vision.num_hidden_layers
        layers = mm.vision_feature_layer
        self.feature_layers = [i % (total + 1) for i in
                               ([layers] if isinstance(layers, int) else layers)]
        vision.num_hidden_layers = max(max(self.feature_layers), 1)
        self.vision_tower = AutoModel.from_config(vision, dtype=dtype).to(device)
        self.multi_modal_projector = LlavaMultiModalProjector(mm).to(device=device,
                                                                     dtype=dtype)
        for p in (*self.vision_tower.parameters(), *self.multi_modal_projector.parameters()):
            p.loads_itself = True  # loaded here, not by the decoder's shared loader

    def encode_images(self, inputs: list[dict]) -> list[torch.Tensor]:
        """Per image, its [tokens, hidden] features as transformers' get_image_features
        makes them (one tower call for the step's images)."""
        mm = self.mm_config
        dtype = next(self.vision_tower.parameters()).dtype
        pixels = torch.cat([x["pixel_values"] for x in inputs]).to(dtype)
        states = self.vision_tower(pixels, output_hidden_states=True,
                                   return_dict=True).hidden_states
        picked = [states[i] for i in self.feature_layers]
        if mm.vision_feature_select_strategy == "default":  # drop the CLS token
            picked = [s[:, 1:] for s in picked]
        return list(self.multi_modal_projector(torch.cat(picked, dim=-1)))

    def load_weights(self, weights) -> None:
        decoder, parts = split_checkpoint(weights, {"vision": _VISION, "projector": _PROJECTOR},
                                          _HEAD, _TEXT)
        super().load_weights(decoder)
        load_module(self.vision_tower, parts["vision"], "vision tower")
        load_module(self.multi_modal_projector, parts["projector"], "multi-modal projector")

