"""safetensors shard headers: an 8-byte little-endian length, then JSON (dtype, shape, data_offsets relative
to the end of the header). Read with the shard's first HEADER_PROBE bytes, and a second read only for a header
longer than that; cached by object ETag."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from moetune.workers.weights.errors import WeightsError, tensor_list

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
# a shard's first bytes read at once, header length and header together: one round trip instead of two for
# headers up to this size (~2,000 tensors; Kimi-K2-sized releases hold about that many per shard)
HEADER_PROBE = 256 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the shard file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def parse_header(shard: str, raw: bytes, data_start: int, file_size: int | None) -> dict[str, TensorInfo]:
    """Tensors of one shard, each checked: known dtype, size = shape × dtype size, inside the file."""
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise WeightsError(f"shard {shard}: unreadable safetensors header ({e})") from None
    tensors, bad = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        info = TensorInfo(name, dtype, shape, data_start + begin, data_start + end)
        if dtype not in DTYPE_SIZES or info.nbytes != math.prod(shape) * DTYPE_SIZES[dtype] or begin > end \
                or (file_size is not None and info.end > file_size):
            bad.append(name)
        tensors[name] = info
    if bad:
        raise WeightsError(f"shard {shard}: header entries inconsistent with dtype/shape or file size: "
                           f"{tensor_list(bad)}")
    return tensors


def read_header(fs, path: str, shard: str, file_size: int | None, cache=None, etag: str | None = None,
                head: bytes | None = None):
    """(tensors, header bytes) of the shard at `path`; the raw header comes from `cache` when it has this ETag.
    `head`: the shard's first bytes when already read (up to HEADER_PROBE of them)."""
    raw = cache.get_header(path, etag) if cache and etag else None
    if raw is None:
        if head is None:
            try:
                head = fs.cat_file(path, start=0, end=HEADER_PROBE)
            except OSError as e:  # e.g. an empty object: no range of it can be read
                raise WeightsError(f"shard {shard}: cannot be read ({e})") from None
        if len(head) < 8:
            raise WeightsError(f"shard {shard}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head[:8])
        if length > MAX_HEADER_BYTES:
            raise WeightsError(f"shard {shard}: header length {length} is not a safetensors header")
        raw = head[8:8 + length]
        if len(raw) < length and len(head) == HEADER_PROBE:  # a longer header than the probe: the rest of it
            raw += fs.cat_file(path, start=HEADER_PROBE, end=8 + length)
        if len(raw) != length:
            raise WeightsError(f"shard {shard}: header truncated ({len(raw)} of {length} bytes)")
        if cache and etag:
            cache.put_header(path, etag, raw)
    return parse_header(shard, raw, 8 + len(raw), file_size)
