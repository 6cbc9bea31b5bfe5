"""How much image input one prompt may carry: the engine's own limits, applied to every
prompt however it arrived (offline `multi_modal_data`, chat image parts, the server).

Public interface:
    DEFAULT_IMAGES_PER_PROMPT, DEFAULT_MAX_IMAGE_PIXELS
    parse_limit_mm_per_prompt(value) -> {"image": n}    vLLM's --limit-mm-per-prompt: a JSON
                                       object {"image": 4}, or its older spelling image=4
    check_image_count(n, limit, field)                  QuireValidationError past the limit
    check_image_pixels(image, limit, field)             the same for width x height

The pixel limit is checked on the image's header (PIL reads the size before it decodes the
pixels), so an 8000 x 8000 PNG is refused without 192 MB of pixels being made.
"""

from __future__ import annotations

import json

from quire.validation import QuireValidationError

MODALITIES = ("image",)
DEFAULT_IMAGES_PER_PROMPT = 4
# 4096 x 4096: above any processor's working size (they resize down to hundreds of pixels
# a side) and far below a decompression bomb; PIL's own warning starts at 89.5 M
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
FLAG = "limit_mm_per_prompt"


def parse_limit_mm_per_prompt(value: object) -> dict[str, int]:
    """None -> the defaults; a dict or its JSON; or "image=4" (vLLM's older form)."""
    if value is None:
        return {"image": DEFAULT_IMAGES_PER_PROMPT}
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise QuireValidationError(FLAG, f"{FLAG} is not valid JSON: {e}",
                                           value) from None
        else:
            value = dict(_pair(item) for item in text.split(",") if item.strip())
    if not isinstance(value, dict):
        raise QuireValidationError(FLAG, f"{FLAG} must be an object like {{\"image\": 4}}, "
                                   f"got {value!r}", value)
    out = {"image": DEFAULT_IMAGES_PER_PROMPT}
    for modality, n in value.items():
        if modality not in MODALITIES:
            raise QuireValidationError(
                FLAG, f"{FLAG} names {modality!r}; the modalities here are "
                f"{', '.join(MODALITIES)}", value)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise QuireValidationError(
                FLAG, f"{FLAG}[{modality!r}] must be an integer >= 0 (0: none), got {n!r}",
                value)
        out[modality] = n
    return out


def _pair(item: str) -> tuple[str, int]:
    key, sep, n = item.partition("=")
    try:
        if not sep:
            raise ValueError
        return key.strip(), int(n)
    except ValueError:
        raise QuireValidationError(
            FLAG, f"{FLAG} must be JSON like {{\"image\": 4}} or image=4, got "
            f"{item.strip()!r}", item) from None


def check_image_count(n: int, limit: int, field: str) -> None:
    if n > limit:
        raise QuireValidationError(
            field, f"{field} has {n} images; at most {limit} are accepted per prompt "
            f"(--limit-mm-per-prompt '{{\"image\": {limit}}}')", n)


def check_image_pixels(image, limit: int, field: str) -> None:
    width, height = image.size
    if width * height > limit:
        raise QuireValidationError(
            field, f"{field} is {width}x{height} = {width * height} pixels; at most {limit} "
            "are accepted (--max-image-pixels)", (width, height))
    if width < 1 or height < 1:
        raise QuireValidationError(field, f"{field} is {width}x{height}: empty", (width,
                                                                                  height))
