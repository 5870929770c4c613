"""The driver's check of every image a data file names, before any worker starts: the model takes images at all,
the row holds no more than the limit, each URL reaches only what the tenant may read, each object exists, and
each image decodes within the limits, and (with `too_long`) the row fits the context with its image tokens. A bad
image never reaches a worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moetune.api import storage
from moetune.api.chat_content import DATA_URL_PREFIX, image_url_refusal, image_urls
from moetune.api.images import ImageError, ImageLimits, check_image, check_size, data_url_bytes
from moetune.api.uri_access import UriAccess


Checked = tuple[str | None, tuple[int, int] | None]  # (problem, (width, height)): one of the two


@dataclass
class ImageCheck:
    access: UriAccess
    limits: ImageLimits
    refusal: str | None  # why the model cannot take images (api.families.images_refusal); None: it can
    # (row, each image's (width, height)) -> why the row is too long with its image tokens, or None
    too_long: Callable[[dict, list[tuple[int, int]]], str | None] | None = None
    _objects: dict[str, Checked] = field(default_factory=dict)  # URI -> its check: an object is read once

    def row_problem(self, row: dict) -> str | None:
        """What is wrong with the images of one (well-formed) row, or None."""
        urls = list(image_urls(row))
        if len(urls) > self.limits.max_images_per_row:
            return f"holds {len(urls)} images, over the limit of {self.limits.max_images_per_row} per row"
        sizes = []
        for where, url in urls:
            problem, size = image_url_refusal(url, self.access, self.refusal), None
            if not problem:
                problem, size = self._checked(url)
            if problem:
                return f"'{where}' {problem}"
            sizes.append(size)
        return self.too_long(row, sizes) if sizes and self.too_long else None

    def _checked(self, url: str) -> Checked:
        if not url.startswith(DATA_URL_PREFIX):
            if url not in self._objects:
                self._objects[url] = self._checked_object(url)
            return self._objects[url]
        try:
            return None, check_image(data_url_bytes(url), self.limits)
        except ImageError as e:
            return str(e), None

    def _checked_object(self, url: str) -> Checked:
        fs, path = storage.filesystem(url)
        try:
            check_size(fs.size(path), self.limits)
            return None, check_image(fs.cat_file(path), self.limits)
        except FileNotFoundError:
            return f"names {url}, which does not exist", None
        except PermissionError:
            return f"names {url}, which cannot be read (access denied)", None
        except ImageError as e:
            return f"names {url}, which {e}", None
