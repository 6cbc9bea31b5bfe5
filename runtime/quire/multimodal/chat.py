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


def render_image_chat(mm_processor, tokenizer, messages: list[dict],
                      add_generation_prompt: bool, chat_template: str | None = None,
                      tools: list[dict] | None = None, **template_kwargs) -> str:
    """The conversation's text (image parts as {"type": "image"}) through the processor's own
    chat template, which places the family's image placeholder per image part (the
    tokenizer's, when the processor has none); `chat_template` overrides it. `tools`, tool
    calls and results go in as for a text chat (tool_calls/render.py: the template's own way,
    or Hermes-style for one that knows no tools)."""
    processor = mm_processor.processor
    template = chat_template or getattr(processor, "chat_template", None) \
        or getattr(tokenizer, "chat_template", None)
    if not template:
        raise QuireValidationError(FIELD, "this model has no chat template to place the "
                                   "images with; give chat_template, or a prompt with the "
                                   f"image placeholder {mm_processor.image_token!r}")
    messages, template_kwargs = with_tools(template, messages, tools, template_kwargs)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, chat_template=template,
                                         **template_kwargs)


def with_tools(template: str, messages: list[dict], tools: list[dict] | None,
               template_kwargs: dict) -> tuple[list[dict], dict]:
    """(messages, template variables) with the tools in, for this template."""
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages, template_kwargs
    from quire.entrypoints.tool_calls.render import template_inputs
    messages, extra = template_inputs(template, messages, tools)
    return messages, {**template_kwargs, **extra}
