"""Is it an image the workers can take? The bytes of a `data:image/...;base64,` URL, and the checks every image
passes before any worker starts (format, size, pixels, a full decode). Torch-free; Pillow reads the images."""

from __future__ import annotations

import base64
import binascii
import io

from pydantic import BaseModel, Field

from moetune.api.chat_content import DATA_URL_PREFIX

FORMATS = ("JPEG", "PNG", "WEBP")  # OpenAI's vision fine-tuning formats
MB = 1_000_000


class ImageError(ValueError):
    """What is wrong with one image, phrased to follow its field path."""


class ImageLimits(BaseModel):
    """Per-image and per-row limits (the operator's settings; defaults as OpenAI's vision fine-tuning)."""

    max_image_bytes: int = Field(10 * MB, ge=1)
    max_images_per_row: int = Field(10, ge=1)
    max_image_pixels: int = Field(6000 * 6000, ge=1)  # checked before decoding: no decompression bombs


def data_url_bytes(url: str) -> bytes:
    """The image bytes of a `data:image/<format>;base64,<data>` URL."""
    header, sep, data = url.partition(",")
    if not sep or not header.startswith(DATA_URL_PREFIX) or not header.endswith(";base64"):
        raise ImageError("is not a data:image/<format>;base64,<data> URL")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("holds data that is not valid base64") from None


def check_size(n_bytes: int, limits: ImageLimits) -> None:
    """Checked before an object is read, too: a huge object is never downloaded."""
    if n_bytes > limits.max_image_bytes:
        raise ImageError(f"is {n_bytes:,} bytes, over the limit of {limits.max_image_bytes:,} bytes "
                         f"({limits.max_image_bytes / MB:g} MB) per image")


def check_image(data: bytes, limits: ImageLimits) -> tuple[int, int]:
    """(width, height) of an image within the limits that decodes completely; ImageError otherwise."""
    from PIL import Image, UnidentifiedImageError

    check_size(len(data), limits)
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in FORMATS:
                raise ImageError(f"is a {image.format} image; supported formats: {', '.join(FORMATS)}")
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise ImageError(f"is {width}x{height} pixels, over the limit of {limits.max_image_pixels:,} "
                                 "pixels per image")
            image.load()  # truncated or corrupt data fails here, not in a worker
    except UnidentifiedImageError:
        raise ImageError(f"is not an image (supported formats: {', '.join(FORMATS)})") from None
    except Image.DecompressionBombError:
        raise ImageError(f"is over the limit of {limits.max_image_pixels:,} pixels per image") from None
    except OSError as e:
        raise ImageError(f"cannot be decoded ({e})") from None
    return width, height
