"""Chat message content in OpenAI's format: a string, or a list of parts, `{"type": "text", "text": ...}` and
`{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`. Torch-free: the control plane's submission
scan, the driver's row checks and the workers' tokenization all read content through these functions."""

from __future__ import annotations

from collections.abc import Iterator

from moetune.api.models.base import URI_SCHEMES
from moetune.api.uri_access import UriAccess

IMAGE_DETAILS = ("auto", "low", "high")
DATA_URL_PREFIX = "data:image/"
WEB_SCHEMES = ("http://", "https://")


def url_problem(url: str) -> str | None:
    """What is wrong with an image URL by its form alone (fetching and decoding are checked later), or None."""
    if url.startswith(DATA_URL_PREFIX):
        return None
    if url.startswith(WEB_SCHEMES):
        return ("is a web URL: the workers fetch nothing from the internet; send the image inline as a "
                "data:image/...;base64, URL or put it in object storage (s3://...)")
    if url.startswith(URI_SCHEMES):
        return None
    return f"must be a data:image/...;base64, URL or an object-storage URI ({', '.join(URI_SCHEMES)})"


def image_url_refusal(url: str, access: UriAccess, model_refusal: str | None) -> str | None:
    """What refuses an image URL before it is read, phrased to follow the field path: its form, the tenant's storage
    access, then the model (`model_refusal`: why it takes no images, api.families.images_refusal). None: read it."""
    if problem := url_problem(url):
        return problem
    if not url.startswith(DATA_URL_PREFIX) and (refused := access.problem(url)):
        return f"is refused: {refused}"
    return f"is an image, but {model_refusal}" if model_refusal else None


def _part_problem(part, where: str, role: str) -> str | None:
    if not isinstance(part, dict):
        return f"{where}' must be an object with a 'type'"
    kind = part.get("type")
    if kind == "text":
        return None if isinstance(part.get("text"), str) else f"{where}.text' must be a string"
    if kind != "image_url":
        return f"{where}.type' must be 'text' or 'image_url'"
    if role == "assistant":  # as OpenAI: a model learns to answer about images, not to produce them
        return f"{where}' is an image in an assistant turn; images are allowed in user and system turns only"
    image = part.get("image_url")
    if not isinstance(image, dict) or not isinstance(image.get("url"), str) or not image["url"]:
        return f"{where}.image_url.url' must be a non-empty string"
    if image.get("detail", "auto") not in IMAGE_DETAILS:
        return f"{where}.image_url.detail' must be one of {', '.join(IMAGE_DETAILS)}"
    problem = url_problem(image["url"])
    return f"{where}.image_url.url' {problem}" if problem else None


def content_problem(content, where: str, role: str) -> str | None:
    """What is wrong with one message's content, or None; `where` opens the field path (e.g. "'messages[2]")."""
    if isinstance(content, str):
        return None
    if not isinstance(content, list) or not content:
        return f"{where}.content' must be a string or a non-empty list of content parts"
    for j, part in enumerate(content):
        if problem := _part_problem(part, f"{where}.content[{j}]", role):
            return problem
    return None


def image_urls(row) -> Iterator[tuple[str, str]]:
    """(field path, url) of every image part of a row, skipping whatever is malformed (the row checks say why)."""
    messages = row.get("messages") if isinstance(row, dict) else None
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            image = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
            if isinstance(image, dict) and isinstance(image.get("url"), str):
                yield f"messages[{i}].content[{j}].image_url.url", image["url"]


def has_images(content) -> bool:
    return isinstance(content, list) and any(part["type"] == "image_url" for part in content)


def joined_text(content) -> str:
    """The text of a content without images, as chat templates that take a list of parts render it: the text
    parts one after the other (Qwen's, Llama's, GLM's templates loop over the parts with no separator)."""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)
