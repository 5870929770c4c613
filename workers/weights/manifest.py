"""`moetune-manifest.json` at a checkpoint's root, written by `moetune models push`: size and sha256 of every
file, sha256 of every tensor and, for fused expert tensors [E, ...], of every expert's slice, so that a rank
reading only its experts can still verify each byte it receives."""

from __future__ import annotations

import hashlib
import json

from moetune.workers.weights.errors import WeightsError

MANIFEST_FILE = "moetune-manifest.json"
FORMAT = "moetune-manifest/1"


def is_fused_experts(name: str, shape) -> bool:
    """Fused routed-expert tensors: `<...>.experts.<name>` of shape [E, ...], contiguous per expert along dim 0."""
    parts = name.split(".")
    return len(shape) == 3 and len(parts) >= 2 and parts[-2] == "experts"


def sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_entry(name: str, shape, data: memoryview) -> dict:
    entry = {"sha256": sha256(data)}
    if is_fused_experts(name, shape):
        row = len(data) // shape[0]
        entry["expert_sha256"] = [sha256(data[e * row:(e + 1) * row]) for e in range(shape[0])]
    return entry


def manifest(files: dict[str, dict], tensors: dict[str, dict]) -> bytes:
    return json.dumps({"format": FORMAT, "files": files, "tensors": tensors}, indent=1, sort_keys=True).encode()


def parse(raw: bytes, where: str) -> dict:
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise WeightsError(f"{where}: unreadable manifest ({e})") from None
    if data.get("format") != FORMAT:
        raise WeightsError(f"{where}: manifest format {data.get('format')!r}, expected {FORMAT!r}")
    return data
