"""At submission, a quick scan of a job's data files for the images their rows name: every image URI within the
tenant's storage access, and images only for a model that takes them (a 422 naming the file, row and field).

Files over MOETUNE_SUBMISSION_SCAN_MAX_MB, and files storage cannot give now, are left to the driver, which checks
every row, reads every image object and decodes every image before any worker starts (workers/data/images.py).
A file that passed is remembered for a few seconds with what else storage confirmed (storage_facts): a run of
creates naming it reads it once, new bytes within those seconds are the driver's to check, and a refused file is
read again on the next request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from moetune.api import storage
from moetune.api.chat_content import image_url_refusal, image_urls
from moetune.api.families import images_refusal
from moetune.api.images import MB
from moetune.api.models.base import SpecError
from moetune.api.models.job_create import JobCreate
from moetune.api.uri_access import UriAccess
from moetune.service.settings import Settings
from moetune.service.submission.storage_facts import StorageFacts

_DATA_FIELDS = ("training_file", "validation_file")


@dataclass(frozen=True)
class _Scan:
    rows: int  # non-blank lines
    images: tuple[tuple[int, tuple[tuple[str, str], ...]], ...]  # (line number, its image (field path, url)s)


def _scan(text: str) -> _Scan:
    rows, images = 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        rows += 1
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the driver names malformed rows
        if urls := tuple(image_urls(row)):
            images.append((number, urls))
    return _Scan(rows, tuple(images))


def _scanned(uri: str, settings: Settings) -> _Scan | None:
    """The file's rows and image URLs, or None when it is too large to scan here or storage cannot give it now."""
    try:
        fs, path = storage.filesystem(uri, settings.s3_endpoint_url, quick=True, listings_cache=False)
        if fs.info(path)["size"] > settings.submission_scan_max_mb * MB:
            return None
        return _scan(fs.cat_file(path).decode("utf-8"))
    except Exception:  # noqa: BLE001 - missing, unreachable or not text: the file check and the driver report it
        return None


def check_data_images(spec: JobCreate, config: dict | None, access: UriAccess, settings: Settings,
                      facts: StorageFacts | None = None) -> dict[str, int]:
    """Raises SpecError at the first image URL refused before reading (api.chat_content.image_url_refusal): outside
    the tenant's storage, or any image when the model (`config`; None: storage could not give it) or the job's context
    parallelism takes none.
    Returns the number of rows of each file scanned, by field (the submission limits' dataset size)."""
    refusal = images_refusal(config, spec.parallelism) if config is not None else None
    rows: dict[str, int] = {}
    for param in _DATA_FIELDS:
        uri = getattr(spec, param)
        key = ("scan", settings.s3_endpoint_url, uri)
        if uri is None or (scan := (facts and facts.known(key)) or _scanned(uri, settings)) is None:
            continue
        for number, urls in scan.images:
            if problem := _first_refusal(urls, access, refusal):
                raise SpecError(param, f"{param} {uri} row {number}: {problem}")
        rows[param] = scan.rows
        if facts is not None:  # a file that passed, as every fact storage confirmed; a refused one is read again
            facts.remember(key, scan)
    return rows


def row_image_refusal(row, access: UriAccess, model_refusal: str | None) -> str | None:
    """The first image URL of a row refused before reading (its form, the tenant's storage access, the model:
    api.chat_content.image_url_refusal), with its field path; None when there is none."""
    return _first_refusal(image_urls(row), access, model_refusal)


def _first_refusal(urls, access: UriAccess, model_refusal: str | None) -> str | None:
    for where, url in urls:
        if problem := image_url_refusal(url, access, model_refusal):
            return f"'{where}' {problem}"
    return None
