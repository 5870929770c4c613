"""Real image files for the image-input tests, made with Pillow, and the chat rows that carry them."""

from __future__ import annotations

import base64
import io


def image_bytes(width: int = 8, height: int = 8, fmt: str = "PNG", colour=(200, 30, 30)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format=fmt)
    return out.getvalue()


def noise_png(width: int = 32, height: int = 32) -> bytes:
    """A PNG that does not compress away: cut in half, its pixel data is cut too."""
    import random

    from PIL import Image

    pixels = random.Random(0).randbytes(width * height * 3)
    out = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_row(*urls: str, question: str = "what colour?", answer: str = "red") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": question}, *parts]},
                         {"role": "assistant", "content": answer}]}
