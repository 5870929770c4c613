"""`moetune-manifest.json` at a checkpoint's root, written by `moetune models push`: size and sha256 of every
file, a checksum of every tensor and, for fused expert tensors [E, ...], of every expert's slice, so that a rank
reading only its experts can still verify each byte it receives.

Tensors are checked with XXH3-128 since format 2: the checksum guards against bytes corrupted in storage or in
transit (as S3's own CRC checksums do), not against tampering (whoever can rewrite the weights can rewrite the
manifest beside them), and at 0.05 CPU-s per GiB against sha256's 0.6 it no longer costs a loader more than its
reads. Format 1 manifests (sha256 per tensor) still load.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import xxhash

from moetune.workers.weights.errors import WeightsError

MANIFEST_FILE = "moetune-manifest.json"
FORMAT = "moetune-manifest/2"
_READABLE = ("moetune-manifest/1", FORMAT)
TENSOR_CHECKSUM = "xxh3_128"
_HASHES = {"sha256": hashlib.sha256, TENSOR_CHECKSUM: xxhash.xxh3_128}


@dataclass(frozen=True)
class Checksum:
    """A tensor's (or expert slice's) checksum from the manifest."""

    algorithm: str  # a key of _HASHES
    hexdigest: str

    def matches(self, data) -> bool:
        return _HASHES[self.algorithm](data).hexdigest() == self.hexdigest


def is_fused_experts(name: str, shape) -> bool:
    """Fused routed-expert tensors: `<...>.experts.<name>` of shape [E, ...], contiguous per expert along dim 0:
    weights [E, out, in] and, where a family has them, biases [E, out], which an EP rank also reads by the
    expert."""
    parts = name.split(".")
    return len(shape) >= 2 and len(parts) >= 2 and parts[-2] == "experts"


def sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def checksum(data) -> str:
    return _HASHES[TENSOR_CHECKSUM](data).hexdigest()


def tensor_entry(name: str, shape, data: memoryview) -> dict:
    entry = {TENSOR_CHECKSUM: checksum(data)}
    if is_fused_experts(name, shape):
        row = len(data) // shape[0]
        entry[f"expert_{TENSOR_CHECKSUM}"] = [checksum(data[e * row:(e + 1) * row]) for e in range(shape[0])]
    return entry


def tensor_checksum(entry: dict) -> Checksum | None:
    """A tensor entry's checksum (None: the manifest has none for it)."""
    return next((Checksum(a, entry[a]) for a in _HASHES if a in entry), None)


def expert_checksums(entry: dict, experts: int) -> list[Checksum | None]:
    """The checksum of each expert's slice of a fused [E, ...] tensor entry (None for each when it has none)."""
    for algorithm in _HASHES:
        if (digests := entry.get(f"expert_{algorithm}")) is not None:
            return [Checksum(algorithm, d) for d in digests]
    return [None] * experts


def manifest(files: dict[str, dict], tensors: dict[str, dict]) -> bytes:
    return json.dumps({"format": FORMAT, "files": files, "tensors": tensors}, indent=1, sort_keys=True).encode()


def parse(raw: bytes, where: str) -> dict:
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise WeightsError(f"{where}: unreadable manifest ({e})") from None
    if data.get("format") not in _READABLE:
        raise WeightsError(f"{where}: manifest format {data.get('format')!r}, expected one of {', '.join(_READABLE)}")
    return data
