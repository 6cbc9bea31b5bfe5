"""An image as a request gives it: checked, decoded (data URLs only, here) and hashed.

Public interface:
    as_images(value, field, max_pixels)
                                   a PIL image or a list of them -> list; ValueError naming
                                   the field otherwise
    image_from_url(url, field, max_pixels)
                                   a data:image/...;base64 URL -> PIL image
    image_from_bytes(data, field, max_pixels)
                                   encoded image bytes (a fetched URL's) -> PIL image
    image_hash(image)              sha256 hex of the decoded pixels, size and mode

The hash is of the decoded pixels, not of the bytes they came in: the same picture as PNG
and as a PIL image made in memory is one image to the encoder cache and the prefix cache.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings

from quire.multimodal.limits import DEFAULT_MAX_IMAGE_PIXELS, check_image_pixels
from quire.validation import QuireValidationError

MAX_DATA_URL_CHARS = 64 * 2**20  # a bound on what one URL may make us decode


def as_images(value: object, field: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
              ) -> list:
    """One image or a list of them, each a PIL image (vLLM's offline `multi_modal_data`)."""
    from PIL import Image
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise QuireValidationError(field, f"{field} is an empty list; give at least one image")
    for i, item in enumerate(items):
        if not isinstance(item, Image.Image):
            raise QuireValidationError(
                field, f"{field}[{i}] must be a PIL.Image.Image, got {type(item).__name__}")
        check_image_pixels(item, max_pixels, f"{field}[{i}]" if len(items) > 1 else field)
    return items


def image_from_url(url: object, field: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """Decodes a `data:image/<type>;base64,<data>` URL (http(s) fetching is the server's)."""
    if not isinstance(url, str) or not url.startswith("data:image/"):
        shown = url[:40] if isinstance(url, str) else type(url).__name__
        raise QuireValidationError(
            field, f"{field} must be a data:image/...;base64 URL here, got {shown!r}")
    if len(url) > MAX_DATA_URL_CHARS:
        raise QuireValidationError(field, f"{field} is longer than {MAX_DATA_URL_CHARS} "
                                   "characters")
    head, sep, data = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise QuireValidationError(field, f"{field} must be base64-encoded (data:image/...;"
                                   "base64,...)")
    try:
        data = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise QuireValidationError(field, f"{field} is not valid base64: {e}") from None
    return image_from_bytes(data, field, max_pixels)


def image_from_bytes(data: bytes, field: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """Decodes an image file's bytes, refusing one over max_pixels from its header, before
    its pixels are decoded."""
    from PIL import Image, UnidentifiedImageError
    try:
        with warnings.catch_warnings():  # ours is the limit that speaks, below PIL's
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            check_image_pixels(image, max_pixels, field)
            image.load()
    except QuireValidationError:
        raise
    except Image.DecompressionBombError as e:  # past PIL's own bound: far past ours
        raise QuireValidationError(field, f"{field} has more than {max_pixels} pixels "
                                   f"(--max-image-pixels): {e}") from None
    except UnidentifiedImageError:
        raise QuireValidationError(field, f"{field} is not an image (its bytes are no format "
                                   "PIL reads: PNG, JPEG, WebP, GIF, BMP, ...)") from None
    except (ValueError, OSError, SyntaxError) as e:
        raise QuireValidationError(field, f"{field} is not a readable image: {e}") from None
    return image


def image_hash(image) -> str:
    """Content hash: mode, size and the raw pixels, length-framed."""
    h = hashlib.sha256(b"quire/image/v1\0")
    mode = image.mode.encode("ascii")
    h.update(len(mode).to_bytes(4, "little") + mode)
    h.update(image.size[0].to_bytes(4, "little") + image.size[1].to_bytes(4, "little"))
    h.update(image.tobytes())
    return h.hexdigest()
