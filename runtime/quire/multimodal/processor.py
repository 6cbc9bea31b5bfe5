"""The processor step: a prompt and its images -> token ids with each image's placeholders
expanded, each image's placeholder run and content hash, and its pixel inputs, exactly as
the model's own transformers processor makes them (AutoProcessor from the checkpoint).

Public interface:
    MultiModalProcessor.of(path, hf_config)    None unless the model takes images
    MultiModalProcessor.process(text, images, add_special_tokens)  -> ProcessedPrompt
    MultiModalProcessor.image_token            the placeholder a text prompt writes per image
    load_processor(path)                       the checkpoint's transformers processor
    images_only(processor_class)               the same class without its video processor

Family-independent: the image token comes from the config (`image_token_index`, or
`image_token_id` as Qwen2.5-VL and Gemma 3 spell it), the placeholder runs from the expanded
ids, and each image's count of embeddings from the processor's output (equal shares, or a
grid per image where the processor gives one). Where the processor gives grids (Qwen2.5-VL)
its pixel_values are every image's patches stacked, [sum of t*h*w, dim]: image i's are its
grid's rows. A family with M-RoPE gets its prompt's (t, h, w) positions (mrope.py).
"""

from __future__ import annotations

from quire.multimodal.images import image_hash
from quire.multimodal.inputs import ImageSpan, ProcessedPrompt
from quire.multimodal.mrope import prompt_positions
from quire.validation import QuireValidationError

FIELD = "multi_modal_data"


def load_processor(path: str):
    """AutoProcessor's, or, where the processor also holds a video processor and torchvision
    (which video processors need) is not installed, the same processor class without it:
    images are all we take, and its image processor and tokenizer are the checkpoint's."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available
    try:
        return AutoProcessor.from_pretrained(path)
    except Exception:
        if is_torchvision_available():
            raise
        from transformers.models.auto.processing_auto import processor_class_from_name
        name = _processor_class_name(path)
        processor_class = processor_class_from_name(name) if name else None
        if processor_class is None or "video_processor" not in _attributes(processor_class):
            raise
        return images_only(processor_class).from_pretrained(path)


def images_only(processor_class: type) -> type:
    """processor_class without its video processor (its own code otherwise)."""
    kept = [a for a in _attributes(processor_class) if a != "video_processor"]
    return type(processor_class.__name__, (processor_class,),
                {"get_attributes": classmethod(lambda cls: list(kept))})


def _attributes(processor_class: type) -> list[str]:
    return list(processor_class.get_attributes())


def _processor_class_name(path: str) -> str | None:
    import json
    import os
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                found = json.load(f).get("processor_class")
            if found:
                return found
    return None


class MultiModalProcessor:
    def __init__(self, processor, image_token_id: int, hf_config=None) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.hf_config = hf_config  # the model's whole config (M-RoPE positions read it)
        # what a text prompt writes per image: Gemma 3's processor expands its begin-of-image
        # token (boi_token) into the run of image tokens; LLaVA and Qwen2.5-VL expand theirs
        self.image_token = (getattr(processor, "boi_token", None)
                            or getattr(processor, "image_token", None))

    @classmethod
    def of(cls, path: str, hf_config) -> MultiModalProcessor | None:
        token_id = getattr(hf_config, "image_token_index", None)
        if token_id is None:
            token_id = getattr(hf_config, "image_token_id", None)
        if token_id is None or getattr(hf_config, "vision_config", None) is None:
            return None
        try:
            processor = load_processor(path)
        except Exception as e:
            raise ValueError(f"cannot load the image processor of {path!r}: {e}") from None
        return cls(processor, int(token_id), hf_config)

    def process(self, text: str, images: list, add_special_tokens: bool = True
                ) -> ProcessedPrompt:
        if self.image_token and text.count(self.image_token) != len(images):
            raise QuireValidationError(
                FIELD, f"the prompt has {text.count(self.image_token)} {self.image_token} "
                f"placeholders for {len(images)} images in {FIELD}; write one per image, in "
                "order")
        images = [_rgb(im) for im in images]
        try:
            out = self.processor(text=text, images=images, return_tensors="pt",
                                 add_special_tokens=add_special_tokens)
        except (ValueError, TypeError, OSError) as e:
            raise QuireValidationError(FIELD, f"{FIELD}: the processor refused the input: "
                                       f"{e}") from None
        ids = out["input_ids"][0].tolist()
        counts = self._counts(out, len(images), ids.count(self.image_token_id))
        spans, pixels, at = [], {}, 0
        per_image = _per_image(out, len(images))
        for i, (image, n) in enumerate(zip(images, counts)):
            offset = ids.index(self.image_token_id, at)
            if ids[offset:offset + n] != [self.image_token_id] * n:
                raise ValueError(f"image {i}'s {n} placeholder tokens are not one run")
            h = image_hash(image)
            spans.append(ImageSpan(h, offset, n))
            pixels.setdefault(h, per_image[i])
            at = offset + n
        positions = (prompt_positions(self.hf_config, out) if self.hf_config is not None
                     else None)
        return ProcessedPrompt(ids, spans, pixels, positions)

    def _counts(self, out, num_images: int, total: int) -> list[int]:
        """Each image's placeholder (and embedding) count."""
        grid = out.get("image_grid_thw")
        if grid is not None:  # patches merged merge_size^2 to a token (Qwen2.5-VL)
            merge = getattr(self.processor.image_processor, "merge_size", 1)
            return [int(g.prod()) // merge**2 for g in grid]
        if total % num_images:
            raise ValueError(f"{total} placeholder tokens don't split over {num_images} images")
        return [total // num_images] * num_images


# per-token outputs, not per image
_PROMPT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def _per_image(out, num_images: int) -> list[dict]:
    """Each image's own processor tensors: rows of those with a row per image; with grids
    (Qwen2.5-VL), pixel_values' rows cut by each grid's t*h*w."""
    grid = out.get("image_grid_thw")
    keep: list[dict] = [{} for _ in range(num_images)]
    for key, value in out.items():
        if key in _PROMPT_KEYS or not hasattr(value, "shape"):
            continue
        if grid is not None and key == "pixel_values":
            parts = value.split(grid.prod(-1).tolist())
        elif value.ndim and value.shape[0] == num_images:
            parts = value.split(1)
        else:
            continue
        for i, part in enumerate(parts):
            keep[i][key] = part.clone()
    return keep


def _rgb(image):
    """RGB as transformers' processors make it (convert_to_rgb): transparency laid over white,
    not dropped (PIL's convert would show the colours hidden under it)."""
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb
    return Image.fromarray(convert_to_rgb(image, return_numpy=True))
