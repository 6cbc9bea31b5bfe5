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
from quire.validation import QuireValidationError

FIELD = "messages"


def chat_images(messages: list[dict]) -> tuple[list[dict], list]:
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
                images.append(image_from_url(url, f"{where}.image_url.url"))
            elif kind == "image_pil":
                images += as_images(part.get("image_pil"), f"{where}.image_pil")
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
