"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP vision tower, Gemma 3's
projector (average-pooled patches, RMS-normed, projected), and the Gemma 3 text decoder,
whose embeddings take the projected image features at the image soft tokens.

Public interface:
    Gemma3ForConditionalGeneration(cfg, backend_factory, max_model_len, dtype, device, quant)
    mm_bidirectional = True      each image's soft tokens attend to one another both ways
    encode_images(list of per-image tensor dicts) -> list of [tokens, hidden] tensors
    load_weights(weights)        checkpoint names below

The tower and the projector are transformers' own modules (SiglipVisionModel through
AutoModel, Gemma3MultiModalProjector), so the image features are transformers' to the bit.
As in transformers, the text embeddings are scaled by sqrt(hidden) and the image features
replace the placeholders' rows after that, unscaled (the model runner's merge does this).

Attention: transformers lets the tokens of an image's run (token_type_ids == 1: the soft
tokens, not the begin/end-of-image tokens around them) see each other in both directions,
in global layers OR(causal, same image) and in sliding ones AND(window, OR(causal, same
image)). `mm_bidirectional` asks the engine for exactly that: per query token a key limit
(multimodal/image_attention.py), and chunks that never end inside an image's run.

Checkpoint names (transformers 5 and the 4.5x releases):
    model.language_model.X | language_model.model.X     -> the decoder's X
    lm_head.X | language_model.lm_head.X                -> lm_head.X (often tied: absent)
    model.vision_tower.X | vision_tower.X               -> the tower
    model.multi_modal_projector.X | multi_modal_projector.X -> the projector
"""

from __future__ import annotations

import torch

from quire.models.gemma import Gemma3ForCausalLM
from quire.models.mm_weights import load_module, split_checkpoint

_VISION = ("model.vision_tower.", "vision_tower.")
_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")
_HEAD = ("language_model.lm_head.", "lm_head.")
_TEXT = ("model.language_model.", "language_model.model.", "language_model.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    mm_bidirectional = True

    def __init__(self, cfg, backend_factory, max_model_len, dtype, device,
                 quant_config=None) -> None:
        super().__init__(cfg, backend_factory, max_model_len, dtype, device, quant_config)
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
        mm = self.mm_config = cfg.multimodal_hf
        self.vision_tower = AutoModel.from_config(mm.vision_config, dtype=dtype).to(device)
        self.multi_modal_projector = Gemma3MultiModalProjector(mm).to(device=device,
                                                                      dtype=dtype)
        for p in (*self.vision_tower.parameters(), *self.multi_modal_projector.parameters()):
            p.loads_itself = True  # loaded here, not by the decoder's shared loader
        # transformers embeds an image token outside the vocabulary as token 0 (its row is
        # replaced by the image's features anyway); inside it, as itself
        self._oov_image_token = (mm.image_token_id
                                 if mm.image_token_id >= cfg.vocab_size else None)

    def embed(self, input_ids):
        if self._oov_image_token is not None:
            input_ids = input_ids.masked_fill(input_ids == self._oov_image_token, 0)
        return super().embed(input_ids)

    def encode_images(self, inputs: list[dict]) -> list[torch.Tensor]:
        """Per image, its [mm_tokens_per_image, hidden] features as transformers'
        get_image_features makes them (one tower call for the step's images)."""
        dtype = next(self.vision_tower.parameters()).dtype
        pixels = torch.cat([x["pixel_values"] for x in inputs]).to(dtype)
        states = self.vision_tower(pixel_values=pixels, return_dict=True).last_hidden_state
        return list(self.multi_modal_projector(states))

    def load_weights(self, weights) -> None:
        decoder, parts = split_checkpoint(weights, {"vision": _VISION, "projector": _PROJECTOR},
                                          _HEAD, _TEXT)
        super().load_weights(decoder)
        load_module(self.vision_tower, parts["vision"], "vision tower")
        load_module(self.multi_modal_projector, parts["projector"], "multi-modal projector")
