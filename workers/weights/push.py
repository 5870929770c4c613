"""`moetune models push` and `inspect`: upload a Hugging Face checkpoint re-sharded for selective reads, and
tell what each expert-parallel rank would read.

Push orders tensors by name with numbers compared as numbers, so a layer's per-expert tensors come expert by
expert and a rank's consecutive experts are one contiguous byte run (fused [E, ...] tensors are contiguous per
expert by layout); shards are cut at the configured size. It writes the manifest last.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
from collections.abc import Callable

from moetune.api import storage
from moetune.api.models.lora import LoraSpec
from moetune.workers.experts.placement import placement_at
from moetune.workers.families import family_for
from moetune.workers.lora.coverage import coverage, modules
from moetune.workers.weights import manifest as manifest_file
from moetune.workers.weights.formats import weight_of
from moetune.workers.weights.header import TensorInfo, read_header
from moetune.workers.weights.loader import (
    INDEX_FILE,
    SINGLE_FILE,
    check_quantized_parts,
    empty_model,
    fused_expert_params,
    is_weight_file,
    open_checkpoint,
    plan_for,
)
from moetune.workers.weights.mapping import NameMapper
from moetune.workers.weights.plan import map_checkpoint

Progress = Callable[[str, int], None]  # (what, bytes done)


def _natural(name: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name) if p]


def local_tensors(local_dir: str) -> dict[str, tuple[str, TensorInfo]]:
    """Every tensor of a local checkpoint: name -> (file, header entry)."""
    fs, _ = storage.filesystem(f"file://{os.path.abspath(local_dir)}")
    index = os.path.join(local_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(local_dir, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{local_dir}: no {INDEX_FILE} and no {SINGLE_FILE}")
    out = {}
    for name in files:
        path = os.path.join(local_dir, name)
        for info in read_header(fs, path, name, os.path.getsize(path)).values():
            out[info.name] = (path, info)
    return out


def _shard_plan(tensors: dict[str, tuple[str, TensorInfo]], shard_bytes: int) -> list[list[str]]:
    """Tensors in natural order, cut into shards of about `shard_bytes`; a quantized weight's parts (codes, scales)
    always land in one shard together, so that one rank's read of a weight never spans two objects."""
    groups: dict[str, list[str]] = {}
    for name in sorted(tensors, key=lambda n: (_natural(weight_of(n)), n)):
        groups.setdefault(weight_of(name), []).append(name)
    shards, size = [[]], 0
    for names in groups.values():
        n = sum(tensors[name][1].nbytes for name in names)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(names)
        size += n
    return shards


def _write_shard(path: str, names: list[str], tensors, digests: dict, progress: Progress | None) -> tuple[int, str]:
    """Writes one safetensors file in `names` order, hashing every tensor (and expert slice) as it goes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        info = tensors[name][1]
        header[name] = {"dtype": info.dtype, "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    whole = hashlib.sha256()
    with open(path, "wb") as out:
        for block in (struct.pack("<Q", len(raw)), raw):
            out.write(block)
            whole.update(block)
        for name in names:
            src, info = tensors[name]
            with open(src, "rb") as f:
                f.seek(info.start)
                data = memoryview(f.read(info.nbytes))
            digests[name] = manifest_file.tensor_entry(name, info.shape, data)
            out.write(data)
            whole.update(data)
            if progress:
                progress(os.path.basename(path), len(data))
    return os.path.getsize(path), whole.hexdigest()


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 * 2**20), b""):
            h.update(block)
    return h.hexdigest()


def push(local_dir: str, uri: str, shard_bytes: int, progress: Progress | None = None) -> dict:
    """Uploads `local_dir` to `uri` re-sharded (index + shards), its other files as they are, then the manifest."""
    tensors = local_tensors(local_dir)
    plan = _shard_plan(tensors, shard_bytes)
    files, digests, weight_map = {}, {}, {}
    fs, root = storage.filesystem(uri)
    root = root.rstrip("/")
    with tempfile.TemporaryDirectory(prefix="moetune-push-") as tmp:
        for i, names in enumerate(plan, 1):
            shard = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
            local = os.path.join(tmp, shard)
            size, digest = _write_shard(local, names, tensors, digests, progress)
            fs.put_file(local, f"{root}/{shard}")
            os.remove(local)
            files[shard] = {"size": size, "sha256": digest}
            weight_map.update(dict.fromkeys(names, shard))
        total = sum(info.nbytes for _, info in tensors.values())
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
        storage.write_bytes(f"{uri.rstrip('/')}/{INDEX_FILE}", index)
        files[INDEX_FILE] = {"size": len(index), "sha256": manifest_file.sha256(index)}
    for dirpath, _, names in os.walk(local_dir):
        for name in sorted(names):
            local = os.path.join(dirpath, name)
            rel = os.path.relpath(local, local_dir).replace(os.sep, "/")
            if is_weight_file(rel):
                continue
            fs.put_file(local, f"{root}/{rel}")
            files[rel] = {"size": os.path.getsize(local), "sha256": _file_digest(local)}
            if progress:
                progress(rel, files[rel]["size"])
    storage.write_bytes(f"{uri.rstrip('/')}/{manifest_file.MANIFEST_FILE}", manifest_file.manifest(files, digests))
    return {"shards": len(plan), "tensors": len(tensors), "bytes": total}


def inspect(uri: str, ep: int = 1, progress=None, lora: LoraSpec | None = None) -> dict:
    """Family, parameter counts, experts, the bytes each rank reads at expert_parallel_size=`ep`, and, with
    `lora`, which modules of each layer type it adapts (workers.lora.coverage)."""
    import torch

    ckpt = open_checkpoint(uri, progress=progress)
    model = empty_model(ckpt.config, torch.float32)
    fam = family_for(model.config)
    adapted = coverage(modules(model, fam, lora.vision), lora, fam) if lora else None
    params = dict(model.named_parameters())
    experts = fused_expert_params(model)
    expert_params = sum(params[name].numel() for name in experts)
    total_bytes = sum(info.nbytes for shard in ckpt.tensors.values() for info in shard.values())
    quantization = ckpt.quantization
    ranks = []
    mapped = map_checkpoint(ckpt.tensors, NameMapper(model), quantization)  # once for every rank
    for rank in range(ep):
        placement = placement_at(ckpt.config, ep, rank)
        plan = plan_for(ckpt, model, placement, mapped)
        check_quantized_parts(model, plan, placement, quantization)  # what the loader would refuse
        ranks.append(plan.nbytes)
    return {"uri": uri, "model_type": ckpt.config.get("model_type"),
            "parameters": sum(p.numel() for p in params.values()),
            "quantization": quantization.format if quantization else None,
            "expert_parameters": expert_params, "moe_layers": len({n.rsplit(".", 1)[0] for n in experts}),
            "experts_per_layer": max(experts.values(), default=0),
            "checkpoint_bytes": total_bytes, "expert_parallel_size": ep, "bytes_per_rank": ranks,
            "manifest": ckpt.manifest is not None,
            "lora": None if adapted is None else {"rows": adapted.rows(), "trainable_parameters": adapted.trainable,
                                                  "warnings": [m for _, m in adapted.warnings(lora)]}}
