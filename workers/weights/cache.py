"""Local byte cache keyed by object ETag: a restarted or resumed job reads the same ranges from local disk
instead of object storage. A changed object has a new ETag, so stale bytes are never served.

The cache is bounded: by MOETUNE_WEIGHTS_CACHE_MAX_GB when set (say, a pod's ephemeral-storage or emptyDir
limit, which the disk's free space does not show), and always by a floor of free space on its disk. A write
that does not fit evicts the least recently used objects first (an object's folder is touched on every use).
Never evicted: an object with a write in progress, and any object the load itself holds (every shard of the
model it loads). So a cache smaller than a model keeps the part it has instead of thrashing: a load that scans
the same shards in the same order would otherwise evict each range just before it is needed again. A range
that still does not fit is not cached, and the load goes on. The ranks of a node share the cache and
its byte count (`.bytes`, under an flock on `.lock`, recounted at every load), so the folder must be on a
node-local filesystem.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from contextlib import contextmanager, suppress

# The cache never fills its disk past 80 %: checkpoints and logs need room there too, and the kubelet starts
# evicting pods when a node's disk has less than 10 % free.
MIN_FREE_FRACTION = 0.20
_LOCK, _LEDGER, _PART = ".lock", ".bytes", ".part-"
STALE_PART_S = 3600  # a half-written file this old belongs to a killed writer


def _tree_bytes(folder: str, drop_stale_parts: bool = False) -> int:
    total, now = 0, time.time()
    for parent, _, files in os.walk(folder):
        for name in files:
            if parent == folder and name.startswith("."):
                continue  # the lock and the ledger
            path = os.path.join(parent, name)
            with suppress(FileNotFoundError):  # a write that just ended
                stat = os.stat(path)
                if drop_stale_parts and name.startswith(_PART) and now - stat.st_mtime > STALE_PART_S:
                    os.remove(path)
                else:
                    total += stat.st_size
    return total


def _writing_into(folder: str) -> bool:
    try:
        return any(name.startswith(_PART) for name in os.listdir(folder))
    except FileNotFoundError:
        return False


class RangeCache:
    def __init__(self, root: str, max_bytes: int | None = None, min_free_fraction: float = MIN_FREE_FRACTION):
        self.root, self.max_bytes, self.min_free_fraction = root, max_bytes, min_free_fraction
        self.skipped_bytes = 0  # bytes this process did not cache for lack of room
        self.held: set[str] = set()  # object folders this load uses: not evicted while it runs
        os.makedirs(root, exist_ok=True)
        with self._locked() as ledger:  # recount once per load: a killed writer may have left the count off
            ledger[0] = _tree_bytes(root, drop_stale_parts=True)
            self._evict(ledger, 0, keep=None)  # the cap may have been lowered since the last load

    @contextmanager
    def _locked(self):
        """The node's cache lock, with the byte count as a one-element list to read and change."""
        with open(os.path.join(self.root, _LOCK), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = os.path.join(self.root, _LEDGER)
            try:
                with open(path) as f:
                    ledger = [int(f.read() or 0)]
            except (FileNotFoundError, ValueError):
                ledger = [0]
            before = ledger[0]
            yield ledger
            if ledger[0] != before:
                with open(path + ".tmp", "w") as f:
                    f.write(str(max(ledger[0], 0)))
                os.replace(path + ".tmp", path)

    def _evict(self, ledger: list[int], nbytes: int, keep: str | None) -> bool:
        """Evicts least recently used objects (never `keep`, nor one being written) until `nbytes` more fit;
        False if they cannot."""
        if self._fits(ledger[0] + nbytes, nbytes):
            return True
        disk = shutil.disk_usage(self.root)
        if self.min_free_fraction * disk.total - (disk.free - nbytes) > ledger[0]:
            return False  # other data fills the disk: emptying the cache would not make the room
        spared = {keep, *self.held}
        objects = sorted((e for e in os.scandir(self.root) if e.is_dir() and e.path not in spared),
                         key=lambda e: e.stat().st_mtime)
        for victim in objects:
            if _writing_into(victim.path):
                continue
            ledger[0] -= _tree_bytes(victim.path)
            shutil.rmtree(victim.path, ignore_errors=True)
            if self._fits(ledger[0] + nbytes, nbytes):
                return True
        return False

    def _fits(self, total: int, nbytes: int) -> bool:
        disk = shutil.disk_usage(self.root)
        if disk.free - nbytes < self.min_free_fraction * disk.total:
            return False
        return self.max_bytes is None or total <= self.max_bytes

    def _release(self, nbytes: int) -> None:
        with self._locked() as ledger:
            ledger[0] -= nbytes

    def hold(self, path: str, etag: str) -> None:
        """This load uses the object: evicting it for another of its ranges would only move the miss."""
        self.held.add(self._dir(path, etag))

    def _dir(self, path: str, etag: str) -> str:
        key = hashlib.sha256(f"{path}\0{etag}".encode()).hexdigest()[:32]
        return os.path.join(self.root, key)

    def _file(self, path: str, etag: str, name: str) -> str:
        return os.path.join(self._dir(path, etag), name)

    def _read(self, file: str) -> bytes | None:
        try:
            with open(file, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        with suppress(FileNotFoundError):  # evicted since: the bytes read are still good
            os.utime(os.path.dirname(file))  # recently used: evicted last
        return data

    @contextmanager
    def _writing(self, file: str, nbytes: int):
        """A file to write `nbytes` to, or None when the cache has no room for them. The file appears under its
        name only if the block ends without an error. Ranks of one node share the cache: written aside, then
        renamed (atomic), so no reader sees half a file."""
        folder = os.path.dirname(file)
        with self._locked() as ledger:  # the room and the half-written file appear together: no evicting it
            if not self._evict(ledger, nbytes, keep=folder):
                self.skipped_bytes += nbytes
                fd = None
            else:
                os.makedirs(folder, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=folder, prefix=_PART)
                ledger[0] += nbytes
        if fd is None:
            yield None
            return
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
            os.replace(tmp, file)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
                self._release(nbytes)

    def _write(self, file: str, data) -> None:
        with self._writing(file, len(data)) as f:
            if f:
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
        """A file to append a range's bytes to as they arrive (None: no room); cached only if the block ends
        without an error."""
        return self._writing(self._file(path, etag, f"{start}-{end}"), end - start)

    def drop_overlapping(self, path: str, etag: str, start: int, end: int) -> None:
        """Forgets cached ranges that overlap [start, end) (their bytes failed a checksum)."""
        folder = self._dir(path, etag)
        with self._locked() as ledger:  # not racing an eviction of the same folder
            for name in os.listdir(folder) if os.path.isdir(folder) else ():
                lo, sep, hi = name.partition("-")
                if sep and lo.isdigit() and hi.isdigit() and int(lo) < end and start < int(hi):
                    os.remove(os.path.join(folder, name))
                    ledger[0] -= int(hi) - int(lo)
