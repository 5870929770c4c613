"""Builds a transformers model holding exactly this rank's weights, streamed from a checkpoint URI.

The model is created with its parameters on the meta device (buffers, e.g. rotary tables, are computed as
usual), then each parameter is allocated empty at its final shape, expert tensors at this rank's share
only, and filled in place by the range fetcher. No rank ever holds the full model or a full shard. Under ZeRO-3
the parameters are allocated a few at a time, and each becomes this rank's partition of it once filled: a rank
never holds its whole share of the frozen weights either.
"""

from __future__ import annotations

import functools
import gc
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from moetune.api import storage
from moetune.api.environment import ENV_WEIGHTS_CACHE_MAX_GB
from moetune.api.families import facts_of
from moetune.api.models.base import SpecError
from moetune.api.quantization import Quantization, quantization_of
from moetune.workers.experts.placement import ExpertPlacement
from moetune.workers.families import auto_model_class, hf_config, known_family
from moetune.workers.weights import manifest as manifest_file
from moetune.workers.weights.batches import load_batches
from moetune.workers.weights.cache import RangeCache
from moetune.workers.weights.errors import WeightsError, tensor_list
from moetune.workers.weights.fetch import FetchStats, RangeFetcher, Source, torch_dtype
from moetune.workers.weights.formats import build, parse_storage_name
from moetune.workers.weights.header import HEADER_PROBE, TensorInfo, read_header
from moetune.workers.weights.mapping import NameMapper
from moetune.workers.weights.plan import MappedCheckpoint, Plan, map_checkpoint, plan_mapped
from moetune.workers.weights.quantized import install, quantized_shape
from moetune.workers.weights.s3 import is_s3, object_head, read_object

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
WEIGHT_FILES = (INDEX_FILE, ".safetensors", manifest_file.MANIFEST_FILE)
_METADATA_READERS = 16  # checkpoint metadata requests at once (the fetcher reads weights with as many threads)


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_FILES)


def streamed_or_unused(relative: str) -> bool:
    """Files of a checkpoint folder nobody downloads whole: the weights (streamed), other weight formats
    (`.bin`, `.pth`, `.gguf`) and subfolders (e.g. `original/` copies). What is left is config, tokenizer and
    processor files."""
    return "/" in relative or is_weight_file(relative) or relative.endswith((".bin", ".pth", ".pt", ".gguf"))


@dataclass
class Checkpoint:
    """What a checkpoint URI holds, read without any tensor data: config, shard headers, manifest."""
    uri: str
    fs: object
    config: dict
    sources: dict[str, Source]
    tensors: dict[str, dict[str, TensorInfo]]  # shard -> tensors
    manifest: dict | None

    @functools.cached_property
    def quantization(self) -> Quantization | None:
        """The checkpoint's quantized format (config.json), or None; an unsupported one is an error."""
        try:
            return quantization_of(self.config)
        except SpecError as e:
            raise WeightsError(f"{self.uri}: {e.message.removeprefix('model: ')}") from None


@dataclass
class StreamedModel:
    model: object
    plan: Plan
    stats: FetchStats
    verified: bool  # every piece checked against the manifest
    seconds: float
    quantization: str | None = None  # the checkpoint's quantized format (moetune.api.quantization)
    quantized_bytes: int = 0  # frozen weights this rank holds still quantized


def _read_optional(fs, path: str) -> bytes | None:
    try:
        return read_object(fs, path) if is_s3(fs) else fs.cat_file(path)
    except FileNotFoundError:
        return None


def _json(raw: bytes | None, what: str) -> dict:
    if raw is None:
        raise WeightsError(f"{what} not found")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise WeightsError(f"{what}: not JSON ({e})") from None


def open_checkpoint(uri: str, cache: RangeCache | None = None, progress=None) -> Checkpoint:
    """config.json, the shard list and every shard's header (cached by ETag). Requests that do not depend on
    each other go at once: the small files, then per shard its ETag and size (with a cache: a cached header
    needs no more), then its header (its first bytes). From S3 without a cache, one request per shard tells its
    ETag, size and header: a release has up to hundreds of shards, each a round trip away."""
    fs, root = storage.filesystem(uri)
    root = root.rstrip("/")
    with ThreadPoolExecutor(_METADATA_READERS, thread_name_prefix="moetune-headers") as pool:
        config_raw, index_raw, manifest_raw = pool.map(lambda name: _read_optional(fs, f"{root}/{name}"),
                                                       ("config.json", INDEX_FILE, manifest_file.MANIFEST_FILE))
        config = _json(config_raw, f"{uri}: config.json")
        try:
            facts_of(config)  # moetune's own answer to an unsupported model_type or a malformed field
        except SpecError as e:
            raise WeightsError(f"{uri}: {e.message.removeprefix('model: ')}") from None
        if index_raw is not None:
            shards = sorted(set(_json(index_raw, f"{uri}: {INDEX_FILE}")["weight_map"].values()))
        elif fs.exists(f"{root}/{SINGLE_FILE}"):
            shards = [SINGLE_FILE]
        else:
            raise WeightsError(f"{uri}: no {INDEX_FILE} and no {SINGLE_FILE}")
        manifest = manifest_file.parse(manifest_raw, uri) if manifest_raw is not None else None
        sources, sizes, heads = {}, {}, {}
        for shard, (source, size, head) in zip(shards, pool.map(
                lambda s: _shard_source(fs, uri, root, s, manifest, probe=cache is None), shards)):
            sources[shard], sizes[shard], heads[shard] = source, size, head
            if cache and source.etag:
                cache.hold(source.path, source.etag)
        # once every shard is held: no header write evicts a later shard
        headers = pool.map(lambda s: read_header(fs, sources[s].path, s, sizes[s], cache, sources[s].etag,
                                                 heads[s]), shards)
        tensors = {}
        for shard, header in zip(shards, headers):
            tensors[shard] = header
            if progress:
                progress(shard)
    return Checkpoint(uri, fs, config, sources, tensors, manifest)


def _shard_source(fs, uri: str, root: str, shard: str, manifest: dict | None,
                  probe: bool) -> tuple[Source, int, bytes | None]:
    """(the shard's Source, its size, its first bytes or None), checked against the manifest. `probe`: read its
    first bytes in the same request where the storage can (S3)."""
    path, head = f"{root}/{shard}", None
    try:
        if probe and is_s3(fs):
            etag, size, head = object_head(fs, path, HEADER_PROBE)
        else:
            info = fs.info(path)
            etag, size = info.get("ETag") or info.get("etag") or f"{info.get('mtime')}-{info['size']}", info["size"]
    except FileNotFoundError:
        raise WeightsError(f"{uri}: shard {shard} is listed in the index but missing") from None
    except OSError as e:  # e.g. an empty object: no range of it can be read
        raise WeightsError(f"{uri}: shard {shard} cannot be read ({e})") from None
    if manifest and manifest["files"].get(shard, {}).get("size") not in (None, size):
        raise WeightsError(f"{uri}: shard {shard} is {size} bytes, the manifest says "
                           f"{manifest['files'][shard]['size']}")
    return Source(path, str(etag).strip('"')), size, head


def empty_model(config: dict, dtype):
    """The model with its parameters and persistent buffers on the meta device (nothing allocated, whatever the
    model's size), and its non-persistent buffers (rotary tables) computed on the CPU.

    Built with meta as the default device, so even a fused [E, ...] expert tensor is never created on the host
    (accelerate's init_empty_weights moves each parameter to meta only after creating it there: 62.5 GB for one
    seed-scale gate_up); the non-persistent buffers are then rebuilt the way transformers' from_pretrained does,
    by the model's own `_init_weights` (on a module whose parameters are still meta, that touches nothing else)."""
    import torch
    config = hf_config(config)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config, dtype=dtype)
    owners = set()
    for name, buffer in model.named_non_persistent_buffers():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._buffers[attr] = torch.empty_like(buffer, device="cpu")
        owners.add(module_name)
    for module_name in sorted(owners):
        model._init_weights(model.get_submodule(module_name))
    return model


def fused_expert_params(model) -> dict[str, int]:
    """Fused routed-expert parameters [E, ...] of the model's family -> E."""
    fam = known_family(model.config)
    found = {}
    for block_name, block in fam.moe_blocks(model) if fam else ():
        experts = getattr(block, fam.experts)
        for name, param in experts.named_parameters(recurse=False):
            if param.shape[:1] == (experts.num_experts,):
                found[f"{block_name}.{fam.experts}.{name}"] = experts.num_experts
    return found


def expert_shares(model, placement: ExpertPlacement | None) -> dict[str, ExpertPlacement]:
    """The fused expert parameters of which this rank holds only its placement's rows."""
    if placement is None or not placement.sharded:
        return {}
    shares = {}
    for name, total in fused_expert_params(model).items():
        if total != placement.num_experts:
            raise WeightsError(f"{name} has {total} experts, the model config {placement.num_experts}")
        shares[name] = placement
    return shares


def allocated_shapes(model, shares: dict[str, ExpertPlacement]) -> dict[str, tuple[int, ...]]:
    return {name: ((shares[name].count, *p.shape[1:]) if name in shares else tuple(p.shape))
            for name, p in model.named_parameters()}


def plan_for(ckpt: Checkpoint, model, placement: ExpertPlacement | None = None,
             mapped: MappedCheckpoint | None = None, held: set[str] | None = None) -> Plan:
    """`mapped`: the checkpoint's names mapped once for every rank planned (map_checkpoint); None maps them here.
    `held`: the parameters and buffers this rank holds (None: all), see stream_model."""
    shares = expert_shares(model, placement)
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    aliases = {name: next(n for n, p in params.items() if p is t)
               for name, t in model.named_parameters(remove_duplicate=False) if name not in params}
    shapes = allocated_shapes(model, shares)
    persistent = model.state_dict(keep_vars=True)
    shapes.update({name: tuple(b.shape) for name, b in model.named_buffers() if name in persistent})
    if held is not None:
        shapes = {name: shape for name, shape in shapes.items() if name in held}
        params = {name: p for name, p in params.items() if name in held}
    digests = ckpt.manifest["tensors"] if ckpt.manifest else None
    mapped = mapped or map_checkpoint(ckpt.tensors, NameMapper(model), ckpt.quantization)
    return plan_mapped(mapped, shapes, set(params), shares, aliases, digests, ckpt.quantization, held)


def _allocate(model, shapes_of: dict[str, tuple], plan: Plan, device, held: set[str] | None = None) -> dict:
    """Replaces every meta parameter (of `held`, None: all) by an empty one of its allocated shape (see
    _allocate_parameters), allocates the buffers and the quantized parts' storage tensors and the staging tensors.
    Returns the tensors to fill by name."""
    return {**_allocate_parameters(model, shapes_of, plan, device, held),
            **_allocate_buffers(model, plan, device, held), **_part_tensors({**plan.storage, **plan.staged}, device)}


def _allocate_parameters(model, shapes_of: dict[str, tuple], plan: Plan, device, only: set[str] | None = None):
    """Replaces each meta parameter (of `only`, None: all) by an empty one of its allocated shape, keeping its
    attributes (tied parameters stay tied), except quantized ones: their parts get storage tensors. Returns the
    tensors to fill by name."""
    import torch

    fresh, targets = {}, {}
    quantized = {parse_storage_name(name)[0] for name in plan.storage}
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        for attr, param in list(module._parameters.items()):
            if param is None or names[id(param)] in quantized or (only is not None and names[id(param)] not in only):
                continue
            if id(param) not in fresh:
                name = names[id(param)]
                new = torch.nn.Parameter(torch.empty(shapes_of[name], dtype=param.dtype, device=device),
                                         requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)  # attributes loading would drop (e.g. hf init flags)
                fresh[id(param)] = new
                targets[name] = new.detach()
            module._parameters[attr] = fresh[id(param)]
    return targets


def _allocate_buffers(model, plan: Plan, device, held: set[str] | None = None) -> dict:
    """The persistent buffers (of `held`, None: all), built on meta like the parameters, allocated on `device`; one
    the checkpoint does not hold keeps its initial value. Returns every allocated buffer by name."""
    import torch

    loaded = {p.param for p in plan.pieces}
    for module_name, module in model.named_modules():
        meta = [attr for attr, buf in module._buffers.items() if buf is not None and buf.device.type == "meta"
                and (held is None or f"{module_name}.{attr}".lstrip(".") in held)]
        for attr in meta:
            module._buffers[attr] = torch.empty_like(module._buffers[attr], device=device)
        if any(f"{module_name}.{attr}".lstrip(".") not in loaded for attr in meta):
            model._init_weights(module)
    return {name: b for name, b in model.named_buffers() if b.device.type != "meta"}


def _part_tensors(names: dict[str, tuple], device) -> dict:
    """Empty storage or staging tensors (name -> (shape, safetensors dtype))."""
    import torch

    return {name: torch.empty(shape, dtype=torch_dtype(dtype), device=device) for name, (shape, dtype) in names.items()}


def _run_conversions(model, conversions: dict, targets: dict) -> None:
    """transformers' own converters (Plan.conversions) on the staged whole tensors (workers.weights.mapping); each
    output is copied into its parameter, and the staging tensors are dropped."""
    import copy

    import torch

    for layer, (conv, sources) in conversions.items():
        converter = copy.copy(conv.converter)  # fresh collected tensors: the mapper's converter is shared
        converter.collected_tensors, converter.layer_targets = defaultdict(list), defaultdict(set)
        for key, stage in sources:
            converter.add_tensor(layer, key, conv.pattern, targets.pop(stage))
        with torch.no_grad():
            for name, tensor in converter.convert(layer, model=model, config=model.config).items():
                tensor = tensor[0] if isinstance(tensor, list) else tensor
                if name not in targets or targets[name].shape != tensor.shape:
                    raise WeightsError(f"{layer}: its conversion gave {name} {list(tensor.shape)}, which the model "
                                       "does not have in that shape")
                targets[name].copy_(tensor)


def quantized_weights(model, plan: Plan, targets: dict, shapes_of: dict, quantization) -> Iterator[tuple]:
    """(parameter, QuantizedWeight) of each quantized parameter, built from its parts (`targets`: storage name ->
    tensor) and checked to fit together (the format's block or group shapes) and to fit the model; a WeightsError
    names the parameter. The loader runs it on the loaded parts, `models inspect` on meta tensors of the planned
    shapes (check_quantized_parts): the same checks."""
    parts = defaultdict(dict)
    for name in plan.storage:
        param, part = parse_storage_name(name)
        parts[param][part] = targets[name]
    for param, tensors in parts.items():
        try:
            qweight = build(quantization, tensors)
        except ValueError as e:
            raise WeightsError(f"{param}: its quantized parts do not fit together ({e})") from None
        if tuple(qweight.shape) != (expected := quantized_shape(model, param, shapes_of[param])):
            raise WeightsError(f"{param}: quantized weight of shape {list(qweight.shape)}, the model's is "
                               f"{list(expected)} ([..., out, in])")
        yield param, qweight


def check_quantized_parts(model, plan: Plan, placement: ExpertPlacement | None, quantization) -> None:
    """The loader's checks of the quantized parts of one rank's plan, on their shapes alone (no data read)."""
    import torch

    if not plan.storage:
        return
    meta = {name: torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
            for name, (shape, dtype) in plan.storage.items()}
    for _ in quantized_weights(model, plan, meta, allocated_shapes(model, expert_shares(model, placement)),
                               quantization):
        pass


def _install_quantized(model, plan: Plan, targets: dict, shapes_of: dict, quantization, dense_dtype,
                       partition=None) -> int:
    """Builds each quantized parameter from its loaded parts and puts it in the model (see
    workers.weights.quantized); returns the bytes of frozen quantized weights this rank now holds. `partition`
    (ZeRO-3): a dequantized parameter is partitioned as soon as it is built."""
    held = 0
    for param, qweight in quantized_weights(model, plan, targets, shapes_of, quantization):
        install(model, param, qweight, dense_dtype)
        held += qweight.nbytes
        if dense_dtype is not None and partition is not None:
            partition(model.get_parameter(param), param)
    return held


def stream_model(uri: str, device, dtype, placement: ExpertPlacement | None = None, cache_dir: str | None = None,
                 cache_max_bytes: int | None = None, base_weights: str = "quantized", partition=None, held=None,
                 **fetch_options) -> StreamedModel:
    """This rank's model from the checkpoint at `uri`: non-expert tensors in full, experts of its placement.
    `held(model)`: the names of the parameters and persistent buffers this rank holds (a pipeline stage's:
    workers.pipeline.stages.stage_tensor_names), asked of the model on the meta device; the others stay there,
    never read (None: all).
    `cache_dir`: the node's weights cache (None or "": none), bounded by `cache_max_bytes` (None: by free disk).
    A quantized checkpoint's frozen weights stay in their stored format, unless `base_weights` is "dequantized"
    (then each is dequantized once, into a dense parameter of `dtype`). `partition` (ZeRO-3, a
    workers.engine.zero3_load.Zero3Partitioner): each dense parameter becomes this rank's ZeRO-3 partition of it
    as soon as it is loaded (see _stream_partitioned)."""
    with _heap_frozen():
        return _stream_model(uri, device, dtype, placement, cache_dir, cache_max_bytes, base_weights, partition,
                             held, **fetch_options)


@contextmanager
def _heap_frozen():
    """Objects made before the load are left out of the garbage collector's passes until it ends. A full pass
    over a worker's heap (~500k objects once torch and transformers are imported) holds the GIL ~0.25 s on a
    2-core VM, stalling every fetch thread; the load's own objects (the skeleton, its parameters) are new and
    long-lived, so no pass over the old ones is due because of them. Cyclic garbage made during the load is
    still collected."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _stream_model(uri: str, device, dtype, placement, cache_dir, cache_max_bytes, base_weights, partition, held,
                  **fetch_options) -> StreamedModel:
    started = time.perf_counter()
    cache = RangeCache(cache_dir, cache_max_bytes) if cache_dir else None
    ckpt = open_checkpoint(uri, cache)
    model = empty_model(ckpt.config, dtype)
    names = held(model) if held is not None else None
    if names is not None and partition is not None:
        raise ValueError("a pipeline stage's weights are loaded whole (ZeRO-1/2), not ZeRO-3 partitioned")
    plan = plan_for(ckpt, model, placement, held=names)
    shapes = allocated_shapes(model, expert_shares(model, placement))
    fetcher = RangeFetcher(ckpt.fs, ckpt.sources, cache, **fetch_options)
    dense = dtype if base_weights == "dequantized" else None
    if partition is None:
        targets = _allocate(model, shapes, plan, device, names)
        stats = fetcher.load(plan.pieces, targets)
        _run_conversions(model, plan.conversions, targets)
        quantized_bytes = _install_quantized(model, plan, targets, shapes, ckpt.quantization, dense) \
            if plan.storage else 0
    else:
        groups = _expert_groups(model, placement)
        stats, quantized_bytes = _stream_partitioned(model, plan, shapes, device, fetcher, ckpt.quantization, dense,
                                                     lambda param, name: partition(param, groups.get(name)))
    stats.bytes_not_cached = cache.skipped_bytes if cache else 0
    for module in model.modules():  # the buffers (parameters are there already), but those of other stages
        module._buffers.update({k: b.to(device) for k, b in module._buffers.items()
                                if b is not None and b.device.type != "meta"})
    model.eval()  # as from_pretrained returns it
    quantization = ckpt.quantization
    verified = ckpt.manifest is not None and stats.verified_pieces == len(plan.pieces)
    return StreamedModel(model, plan, stats, verified, time.perf_counter() - started,
                         quantization.format if quantization else None, 0 if dense else quantized_bytes)


def _expert_groups(model, placement: ExpertPlacement | None) -> dict[str, tuple[str, object]]:
    """Fused expert parameters -> (EP group name, replica group) ZeRO-3 partitions them over: those the
    expert-parallel module takes (its process groups exist, ExpertPlacement.replica_group); the rest go over every
    rank."""
    if placement is None or placement.replica_group is None:
        return {}
    return dict.fromkeys(fused_expert_params(model), (placement.group_name, placement.replica_group))


def _stream_partitioned(model, plan: Plan, shapes: dict, device, fetcher: RangeFetcher, quantization, dense,
                        partition) -> tuple[FetchStats, int]:
    """The loader under ZeRO-3: the buffers and the quantized parts first (held whole, at this rank's share, as
    without ZeRO-3), then the dense parameters batch by batch (workers.weights.batches), each partitioned
    (`partition(param, name)`) before the next batch is allocated. A dequantized parameter is partitioned as soon
    as it is built. Returns the fetch figures and the bytes kept quantized."""
    started = time.perf_counter()
    targets = {**_allocate_buffers(model, plan, device), **_part_tensors(plan.storage, device)}
    stats = fetcher.load([p for p in plan.pieces if p.param in targets], targets)
    params = dict(model.named_parameters())
    quantized = {parse_storage_name(name)[0] for name in plan.storage}
    dense_params = {name: (shapes[name], p.dtype.itemsize) for name, p in params.items() if name not in quantized}
    for batch in load_batches(plan, dense_params):
        filled = {**_allocate_parameters(model, shapes, plan, device, set(batch.params)),
                  **_part_tensors(batch.staged, device)}
        fetcher.load(batch.pieces, filled)
        _run_conversions(model, batch.conversions, filled)
        filled.clear()  # the whole tensors' last references but the parameters' own, which partitioning frees
        allocated = dict(model.named_parameters())
        for name in batch.params:
            partition(allocated[name], name)
    held = _install_quantized(model, plan, targets, shapes, quantization, dense, partition) if plan.storage else 0
    stats.bytes_needed, stats.seconds = plan.nbytes, time.perf_counter() - started
    return stats, held


def load_summary(streamed: StreamedModel, ep_size: int) -> tuple[str, dict]:
    """The job event of a streamed load: time, bytes and throughput, and whether the bytes were verified."""
    s = streamed.stats
    read = s.bytes_from_storage + s.bytes_from_cache
    data = {"load_seconds": round(streamed.seconds, 3), "bytes_needed": s.bytes_needed,
            "bytes_from_storage": s.bytes_from_storage, "bytes_from_cache": s.bytes_from_cache,
            "throughput_mib_s": round(read / 2**20 / max(streamed.seconds, 1e-9), 1), "requests": s.requests,
            "direct_requests": s.direct_requests, "retries": s.retries, "bytes_not_cached": s.bytes_not_cached,
            "integrity": "verified" if streamed.verified else "unverified",
            "expert_parallel_size": ep_size, "quantization": streamed.quantization,
            "quantized_bytes": streamed.quantized_bytes, "unexpected_tensors": streamed.plan.unexpected,
            "quantization_metadata_tensors": len(streamed.plan.metadata)}
    message = (f"Weights streamed: {read / 2**20:.1f} MiB in {streamed.seconds:.2f}s "
               f"({data['throughput_mib_s']} MiB/s; {s.bytes_from_cache / 2**20:.1f} MiB from the local cache)")
    if s.bytes_not_cached:
        message += (f"; {s.bytes_not_cached / 2**20:.1f} MiB not cached: the local weights cache is full "
                    f"({ENV_WEIGHTS_CACHE_MAX_GB} or its disk's free-space floor)")
    if streamed.quantization:
        kept = (f"{streamed.quantized_bytes / 2**20:.2f} MiB kept quantized" if streamed.quantized_bytes
                else "dequantized at load (training.base_weights)")
        message += f"; {streamed.quantization} base: {kept}"
    if s.refused:
        message += f"; ranged GETs through fsspec's client (slower), not the loader's own connections: {s.refused}"
    if streamed.plan.unexpected:
        message += (f"; {len(streamed.plan.unexpected)} checkpoint tensors the model has no place for, ignored: "
                    f"{tensor_list(streamed.plan.unexpected)}")
    if not streamed.verified and not s.verified_pieces:
        message += ("; integrity unverified: the checkpoint has no moetune-manifest.json (push it with "
                    "`moetune models push`)")
    elif not streamed.verified:
        message += (f"; integrity unverified for {len(streamed.plan.pieces) - s.verified_pieces} of "
                    f"{len(streamed.plan.pieces)} pieces: its moetune-manifest.json has no checksum for them (push "
                    "it again with `moetune models push`)")
    return message, data
