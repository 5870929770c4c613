"""Concurrent range reads straight into their destination tensors, with a bound on bytes in flight.

Merged ranges are cut into chunks; at most `max_inflight_bytes // chunk_bytes` chunks are read at once. From
S3, a chunk's response is read straight into the pieces it overlaps as it arrives, 4 MiB at a time (then appended
to its cache file from there; no block buffer; an interrupted response resumes where it stopped), on the
fetcher's own connections (workers.weights.direct) or, where those cannot serve, through fsspec's client; from other
filesystems the whole chunk is read, copied into the pieces and dropped. A piece whose dtype matches and whose
destination is contiguous on the CPU receives bytes in place; others go through a staging buffer of that
one piece (dtype conversion, devices). A piece with a manifest checksum is verified once its last byte has
arrived; a mismatch is read again from storage (up to `attempts` reads), then is an error naming the shard
and tensor.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass, field

from moetune.workers.weights.direct import DirectRefused, direct_ranges
from moetune.workers.weights.errors import WeightsError, tensor_list
from moetune.workers.weights.pages import populate_for_write
from moetune.workers.weights.plan import Piece, merge_ranges
from moetune.workers.weights.s3 import LoopBody, is_s3

log = logging.getLogger(__name__)
MiB = 1024 * 1024
# bytes read into the pieces per call (through fsspec's client: a hop between a fetch thread and its event loop,
# a thread switch both ways); also how often a response's progress is counted, verified and cached (the pieces a
# block finished are verified while the next block is read; one hop per 16 MiB chunk measured the same, within the
# bench's noise)
STREAM_BLOCK = 4 * MiB


def _write_prefix(out, views: list[memoryview], size: int) -> None:
    """The first `size` bytes of `views`, in order, to the file `out`."""
    for view in views:
        out.write(view[:size])
        size -= min(size, len(view))
        if not size:
            return


def torch_dtype(name: str):
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}[name]


@dataclass
class FetchStats:
    bytes_from_storage: int = 0
    bytes_from_cache: int = 0
    bytes_needed: int = 0
    bytes_not_cached: int = 0  # the local cache had no room for them
    requests: int = 0
    direct_requests: int = 0  # of them, sent on the fetcher's own connections (workers.weights.direct)
    refused: str = ""  # why the rest went through fsspec's client (a direct GET refused, a proxy), if they did
    retries: int = 0
    verified_pieces: int = 0
    seconds: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for key, n in counts.items():
                setattr(self, key, getattr(self, key) + n)


@dataclass
class Source:
    """One shard: its path in the filesystem and the ETag that keys its cached bytes."""
    path: str
    etag: str | None


class _Sink:
    """Where one piece's bytes go, and how many are still missing."""

    def __init__(self, piece: Piece, dest):
        import torch

        self.piece, self.dest, self.missing = piece, dest, piece.nbytes
        self.reread = False  # its bytes failed the checksum once: whatever cached them is suspect
        direct = dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == torch_dtype(piece.dtype)
        self.direct = direct
        self.buffer = dest.view(-1).view(torch.uint8) if direct else None

    def bytes_view(self):
        import torch

        if self.buffer is None:  # staging, allocated when the first bytes arrive
            self.buffer = torch.empty(self.piece.nbytes, dtype=torch.uint8)
        return self.buffer.numpy()

    def finish(self) -> None:
        if not self.direct:
            src = self.buffer.view(torch_dtype(self.piece.dtype)).view(self.piece.shape)
            self.dest.copy_(src)  # converts dtype / moves to the device
        self.buffer = None


class RangeFetcher:
    def __init__(self, fs, sources: dict[str, Source], cache=None, chunk_bytes: int = 16 * MiB,
                 max_inflight_bytes: int = 256 * MiB, merge_gap: int = 32 * 1024, attempts: int = 5,
                 backoff_s: float = 0.2):
        self.fs, self.sources, self.cache = fs, sources, cache
        self.chunk_bytes, self.merge_gap = chunk_bytes, merge_gap
        self.workers = max(1, max_inflight_bytes // chunk_bytes)
        self.attempts, self.backoff_s = attempts, backoff_s
        self.stats = FetchStats()
        self.direct = direct_ranges(fs)  # None: every ranged GET goes through fsspec's client

    def _open(self, path: str, start: int, end: int):
        """The open body of a ranged GET: on the fetcher's own connections while storage takes those."""
        if self.direct is not None and not self.stats.refused:
            try:
                body = self.direct.open(path, start, end)
                self.stats.add(direct_requests=1)
                return body
            except DirectRefused as e:
                with self.stats.lock:
                    first = not self.stats.refused
                    self.stats.refused = self.stats.refused or str(e)
                if first:
                    log.warning("ranged GETs go through fsspec's client from now on: %s", e)
        return LoopBody(self.fs, path, start, end)

    # -------------------------------------------------------------- reading

    def _retried(self, shard: str, start: int, end: int, tensors: list[str], attempt) -> None:
        """Calls `attempt()` until it returns None; it returns what went wrong (a short read) or raises.
        Transient storage errors (5xx, throttling, resets) are retried with backoff; the last failure is an
        error naming the shard, the bytes and the tensors they hold."""
        problem = ""
        for i in range(self.attempts):
            if i:
                self.stats.add(retries=1)
                time.sleep(self.backoff_s * 2 ** (i - 1))
            try:
                problem = attempt()
            except (FileNotFoundError, PermissionError) as e:
                raise WeightsError(f"shard {shard}: cannot be read ({e})") from None
            except WeightsError:
                raise
            except Exception as e:  # noqa: BLE001 - storage clients raise many kinds
                problem = f"{type(e).__name__}: {e}"
                continue
            if problem is None:
                return
        raise WeightsError(f"shard {shard}: bytes {start}-{end} (tensors {tensor_list(tensors)}) "
                           f"failed after {self.attempts} attempts: {problem}")

    def _stream_into(self, shard: str, start: int, end: int, sinks: list[_Sink]) -> None:
        """Bytes [start, end) from S3 into `sinks` block by block as the response arrives (no range-sized
        buffer, no copy of the whole range); an interrupted or truncated response is resumed at the first
        byte not yet delivered, so every byte is delivered once."""
        src, pos = self.sources[shard], start
        cached = self.cache.get_range(src.path, src.etag, start, end) if self.cache and src.etag else None
        if cached is not None:
            self.stats.add(bytes_from_cache=len(cached))
            self._deliver(sinks, shard, start, cached)
            return

        def attempt(out) -> str | None:
            nonlocal pos
            self.stats.add(requests=1)
            body = self._open(src.path, pos, end)
            try:
                while pos < end:
                    block = min(STREAM_BLOCK, end - pos)
                    views = self._views(sinks, pos, pos + block)
                    got = body.read_into(views)
                    if out:
                        _write_prefix(out, views, got)
                    self._arrived(sinks, pos, pos + got)
                    pos += got
                    self.stats.add(bytes_from_storage=got)
                    if got < block:  # the response ended early: resumed from `pos` by the next attempt
                        break
            finally:
                body.close()
            return None if pos == end else f"truncated read: {pos - start} of {end - start} bytes"

        caching = self.cache.writing_range(src.path, src.etag, start, end) if self.cache and src.etag \
            else nullcontext()
        with caching as out:
            self._retried(shard, start, end, [s.piece.tensor for s in sinks], lambda: attempt(out))
        if self.cache and src.etag and any(s.reread for s in sinks):
            self.cache.drop_overlapping(src.path, src.etag, start, end)  # it cached the corrupted bytes

    def _read(self, shard: str, start: int, end: int, about: list[Piece], use_cache: bool = True) -> bytes:
        """Bytes [start, end) of `shard`, from the cache or storage; transient failures are retried."""
        src = self.sources[shard]
        if use_cache and self.cache and src.etag:
            data = self.cache.get_range(src.path, src.etag, start, end)
            if data is not None:
                self.stats.add(bytes_from_cache=len(data))
                return data
        got = []

        def attempt() -> str | None:
            data = self.fs.cat_file(src.path, start=start, end=end)
            self.stats.add(requests=1, bytes_from_storage=len(data))
            if len(data) != end - start:
                return f"truncated read: {len(data)} of {end - start} bytes"
            got.append(data)
            return None

        self._retried(shard, start, end, [p.tensor for p in about], attempt)
        if self.cache and src.etag:
            self.cache.put_range(src.path, src.etag, start, end, got[0])
        return got[0]

    # -------------------------------------------------------------- delivering

    def _deliver(self, sinks: list[_Sink], shard: str, start: int, data: bytes) -> None:
        import numpy as np

        offset = 0
        for view in self._views(sinks, start, start + len(data)):
            view[:] = np.frombuffer(data, np.uint8, len(view), offset)
            offset += len(view)
        self._arrived(sinks, start, start + len(data))

    @staticmethod
    def _views(sinks: list[_Sink], start: int, end: int) -> list[memoryview]:
        """Writable views covering bytes [start, end) of the shard in order: the pieces' own memory (a direct
        piece's pages under them faulted in first, workers.weights.pages: block by block rather than a whole
        tensor at its first bytes, which measured 1-2 % slower, the faulting bunched at the start), and scratch for
        the gaps between pieces that merged ranges read."""
        views, pos = [], start
        for sink in sinks:
            p = sink.piece
            lo, hi = max(pos, p.start), min(end, p.end)
            if lo >= hi:
                continue
            if lo > pos:
                views.append(memoryview(bytearray(lo - pos)))
            if sink.direct:
                populate_for_write(sink.buffer.data_ptr() + lo - p.start, hi - lo)
            views.append(memoryview(sink.bytes_view())[lo - p.start:hi - p.start])
            pos = hi
        if pos < end:
            views.append(memoryview(bytearray(end - pos)))
        return views

    def _arrived(self, sinks: list[_Sink], start: int, end: int) -> None:
        """Bytes [start, end) are in the pieces: pieces now whole are verified and finished."""
        for sink in sinks:
            p = sink.piece
            lo, hi = max(start, p.start), min(end, p.end)
            if lo >= hi:
                continue
            with self.stats.lock:
                sink.missing -= hi - lo
                done = sink.missing == 0
            if done:
                self._complete(sink)

    def _complete(self, sink: _Sink) -> None:
        import numpy as np

        p = sink.piece
        if p.checksum is not None:
            reads = 1  # each piece is hashed once per read
            while not p.checksum.matches(sink.bytes_view()):
                if reads == self.attempts:
                    raise WeightsError(f"shard {p.shard}: tensor {p.tensor} does not match its manifest checksum "
                                       "(corrupted in storage or in transit)")
                sink.reread = True  # before dropping: a range still streaming checks it after it is cached
                src = self.sources[p.shard]
                if self.cache and src.etag:
                    self.cache.drop_overlapping(src.path, src.etag, p.start, p.end)
                sink.bytes_view()[:] = np.frombuffer(self._read(p.shard, p.start, p.end, [p], use_cache=False),
                                                     np.uint8)
                reads += 1
            self.stats.add(verified_pieces=1)
        sink.finish()

    def load(self, pieces: list[Piece], params: dict) -> FetchStats:
        """Reads every piece into `params[piece.param]` (tensors already allocated with their final shape)."""
        started = time.perf_counter()
        by_shard: dict[str, list[_Sink]] = {}
        for p in sorted(pieces, key=lambda p: (p.shard, p.start)):
            by_shard.setdefault(p.shard, []).append(_Sink(p, p.destination(params[p.param])))
        starts = {shard: [s.piece.start for s in sinks] for shard, sinks in by_shard.items()}
        self.stats.bytes_needed = sum(p.nbytes for p in pieces)
        streaming = is_s3(self.fs)  # S3: responses are read as they arrive

        def run(shard: str, a: int, b: int) -> None:
            sinks = by_shard[shard]
            # the pieces overlapping [a, b): pieces do not overlap each other, so they are sorted by end too
            first = max(0, bisect.bisect_right(starts[shard], a) - 1)
            last = bisect.bisect_left(starts[shard], b)
            near = sinks[first:last]
            if streaming:
                self._stream_into(shard, a, b, near)
            else:
                self._deliver(near, shard, a, self._read(shard, a, b, [s.piece for s in near]))

        chunks = [(shard, a, min(a + self.chunk_bytes, end))
                  for shard, start, end in merge_ranges(pieces, self.merge_gap)
                  for a in range(start, end, self.chunk_bytes)]
        try:
            with ThreadPoolExecutor(self.workers, thread_name_prefix="moetune-fetch") as pool:
                futures = [pool.submit(run, *chunk) for chunk in chunks]
                done, pending = wait(futures, return_when=FIRST_EXCEPTION)
                for f in pending:
                    f.cancel()
                for f in done:
                    f.result()
        finally:
            if self.direct is not None:
                self.direct.close()
        self.stats.seconds = time.perf_counter() - started
        return self.stats
