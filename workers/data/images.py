"""The driver's check of every image a data file names, before any worker starts: the model takes images at all,
the row holds no more than the limit, each URL reaches only what the tenant may read, each object exists, and
each image decodes within the limits. A bad image never reaches a worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from moetune.api import storage
from moetune.api.chat_content import DATA_URL_PREFIX, image_url_refusal, image_urls
from moetune.api.images import ImageError, ImageLimits, check_image, check_size, data_url_bytes
from moetune.api.uri_access import UriAccess


@dataclass
class ImageCheck:
    access: UriAccess
    limits: ImageLimits
    refusal: str | None  # why the model cannot take images (api.families.images_refusal); None: it can
    _objects: dict[str, str | None] = field(default_factory=dict)  # URI -> problem: an object is read once

    def row_problem(self, row: dict) -> str | None:
        """What is wrong with the images of one (well-formed) row, or None."""
        urls = list(image_urls(row))
        if len(urls) > self.limits.max_images_per_row:
            return f"holds {len(urls)} images, over the limit of {self.limits.max_images_per_row} per row"
        for where, url in urls:
            if problem := image_url_refusal(url, self.access, self.refusal) or self._image_problem(url):
                return f"'{where}' {problem}"
        return None

    def _image_problem(self, url: str) -> str | None:
        if not url.startswith(DATA_URL_PREFIX):
            if url not in self._objects:
                self._objects[url] = self._object_problem(url)
            return self._objects[url]
        try:
            check_image(data_url_bytes(url), self.limits)
        except ImageError as e:
            return str(e)
        return None

    def _object_problem(self, url: str) -> str | None:
        fs, path = storage.filesystem(url)
        try:
            check_size(fs.size(path), self.limits)
            check_image(fs.cat_file(path), self.limits)
        except FileNotFoundError:
            return f"names {url}, which does not exist"
        except PermissionError:
            return f"names {url}, which cannot be read (access denied)"
        except ImageError as e:
            return f"names {url}, which {e}"
        return None
