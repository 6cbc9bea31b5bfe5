"""Chat messages with image parts (vLLM's offline spellings) -> messages a chat template
renders, and the images in the order their placeholders appear.

Public interface:
    chat_images(messages) -> (messages, images)
        parts {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}} and
        {"type": "image_pil", "image_pil": PIL image} become {"type": "image"} (what
        transformers' templates place the image token for); text parts stay
"""

from __future__ import annotations

from quire.multimodal.images import as_images, image_from_url
from quire.multimodal.limits import DEFAULT_MAX_IMAGE_PIXELS
from quire.validation import QuireValidationError

FIELD = "messages"


def chat_images(messages: list[dict], max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
                ) -> tuple[list[dict], list]:
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"{FIELD}[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(image_from_url(url, f"{where}.image_url.url", max_pixels))
            elif kind == "image_pil":
                images += as_images(part.get("image_pil"), f"{where}.image_pil", max_pixels)
            elif kind == "text":
                parts.append(part)
                continue
            else:
                raise QuireValidationError(
                    FIELD, f"{where} has type {kind!r}; here a part is 'text', 'image_url' "
                    "(a data URL) or 'image_pil'")
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def image_chat_template(mm_processor, tokenizer, chat_template: str | None = None) -> str:
    """The template an image chat renders through: `chat_template`, else the processor's own
    (which places the family's image placeholder per image part), else the tokenizer's."""
    template = chat_template or getattr(mm_processor.processor, "chat_template", None) \
        or getattr(tokenizer, "chat_template", None)
    if not template:
        raise QuireValidationError(FIELD, "this model has no chat template to place the "
                                   "images with; give chat_template, or a prompt with the "
                                   f"image placeholder {mm_processor.image_token!r}")
    return template


def render_image_chat(mm_processor, tokenizer, messages: list[dict],
                      add_generation_prompt: bool, chat_template: str | None = None,
                      **template_kwargs) -> str:
    """The conversation's text (image parts as {"type": "image"}) through image_chat_template.
    (Tools go in first, as the text path puts them: tool_calls/render.with_tools.)"""
    template = image_chat_template(mm_processor, tokenizer, chat_template)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, chat_template=template,
                                         **template_kwargs)
