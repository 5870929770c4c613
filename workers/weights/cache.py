"""Local byte cache keyed by object ETag: a restarted or resumed job reads the same ranges from local disk
instead of object storage. A changed object has a new ETag, so stale bytes are never served."""

from __future__ import annotations

import hashlib
import os
import tempfile
from contextlib import contextmanager

ENV_CACHE_DIR = "MOETUNE_WEIGHTS_CACHE_DIR"


def default_cache_dir() -> str | None:
    """MOETUNE_WEIGHTS_CACHE_DIR; empty turns the cache off; unset means a folder in the node's temp dir."""
    value = os.environ.get(ENV_CACHE_DIR)
    if value is None:
        return os.path.join(tempfile.gettempdir(), "moetune", "weights-cache")
    return value or None


class RangeCache:
    def __init__(self, root: str):
        self.root = root

    def _dir(self, path: str, etag: str) -> str:
        key = hashlib.sha256(f"{path}\0{etag}".encode()).hexdigest()[:32]
        return os.path.join(self.root, key)

    def _file(self, path: str, etag: str, name: str) -> str:
        return os.path.join(self._dir(path, etag), name)

    def _read(self, file: str) -> bytes | None:
        try:
            with open(file, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    @contextmanager
    def _writing(self, file: str):
        """A file to write; it appears under its name only if the block ends without an error. Ranks of one
        node share the cache: written aside, then renamed (atomic), so no reader sees half a file."""
        os.makedirs(os.path.dirname(file), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
            os.replace(tmp, file)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def _write(self, file: str, data) -> None:
        with self._writing(file) as f:
            f.write(data)

    def get_header(self, path: str, etag: str) -> bytes | None:
        return self._read(self._file(path, etag, "header"))

    def put_header(self, path: str, etag: str, raw: bytes) -> None:
        self._write(self._file(path, etag, "header"), raw)

    def get_range(self, path: str, etag: str, start: int, end: int) -> bytes | None:
        data = self._read(self._file(path, etag, f"{start}-{end}"))
        return data if data is not None and len(data) == end - start else None

    def put_range(self, path: str, etag: str, start: int, end: int, data) -> None:
        self._write(self._file(path, etag, f"{start}-{end}"), data)

    def writing_range(self, path: str, etag: str, start: int, end: int):
        """A file to append a range's bytes to as they arrive; cached only if the block ends without an error."""
        return self._writing(self._file(path, etag, f"{start}-{end}"))

    def drop_overlapping(self, path: str, etag: str, start: int, end: int) -> None:
        """Forgets cached ranges that overlap [start, end) (their bytes failed a checksum)."""
        folder = self._dir(path, etag)
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            lo, sep, hi = name.partition("-")
            if sep and lo.isdigit() and hi.isdigit() and int(lo) < end and start < int(hi):
                os.remove(os.path.join(folder, name))
