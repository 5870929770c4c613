"""What `moetune models inspect --ep N` spends planning Kimi K3 as released, on a synthetic index of the release's
size (96 shards, 497,220 tensors: each routed expert's w1 / w3 / w2 as MXFP4 weight_packed + weight_scale, the rest
as the empty model names them; names, dtypes, shapes and byte offsets only, no file): every rank of each EP planned
with the loader's inputs (workers.weights.loader.plan_for) and checked as inspect checks it. CPU seconds per EP and
per rank, with the checkpoint's names mapped once (plan.map_checkpoint; each rank visits only its own experts) and,
with --per-rank-mapping, as plan_for maps them, once per rank.

    python bench/weights_plan.py [--ep 8 64] [--per-rank-mapping]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from moetune.api.quantization import quantization_of
from moetune.workers.experts.placement import placement_at
from moetune.workers.weights.header import TensorInfo
from moetune.workers.weights.loader import check_quantized_parts, empty_model, fused_expert_params, plan_for
from moetune.workers.weights.mapping import NameMapper
from moetune.workers.weights.plan import map_checkpoint

RELEASE = Path(__file__).parents[1] / "examples" / "kimi-k3" / "config.json"
SHARDS = 96
ITEM_BYTES = {"U8": 1, "BF16": 2, "F32": 4}
GROUP = 32  # MXFP4: one e8m0 scale byte per 32 values, two values a byte


def release_index(model) -> dict[str, dict[str, TensorInfo]]:
    """The release's tensors in 96 shards, in the order the model names them."""
    fused = fused_expert_params(model)
    tensors = []
    for name, t in model.state_dict(keep_vars=True).items():
        if name not in fused:
            tensors.append((name, "F32" if t.dtype == torch.float32 else "BF16", tuple(t.shape)))
            continue
        experts, rows, cols = t.shape  # gate_up_proj [E, 2I, H] is w1 then w3; down_proj [E, H, I] is w2
        prefix = name.rsplit(".", 1)[0]
        halves = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
        for e in range(experts):
            for w in halves:
                out = rows // len(halves)
                tensors += [(f"{prefix}.{e}.{w}.weight_packed", "U8", (out, cols // 2)),
                            (f"{prefix}.{e}.{w}.weight_scale", "U8", (out, cols // GROUP))]
    per_shard = math.ceil(len(tensors) / SHARDS)
    shards = {}
    for i in range(SHARDS):
        offset, infos = 0, {}
        for name, dtype, shape in tensors[i * per_shard:(i + 1) * per_shard]:
            size = math.prod(shape) * ITEM_BYTES[dtype]
            infos[name] = TensorInfo(name, dtype, shape, offset, offset + size)
            offset += size
        shards[f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"] = infos
    return shards


def plan_every_rank(ckpt, model, config: dict, ep: int, map_once: bool) -> list[int]:
    """Bytes each rank reads, as `moetune models inspect` plans and checks them."""
    mapped = map_checkpoint(ckpt.tensors, NameMapper(model), ckpt.quantization) if map_once else None
    read = []
    for rank in range(ep):
        placement = placement_at(config, ep, rank)
        plan = plan_for(ckpt, model, placement, mapped)
        check_quantized_parts(model, plan, placement, ckpt.quantization)
        read.append(plan.nbytes)
    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--per-rank-mapping", action="store_true", help="map every name again for each rank")
    args = parser.parse_args()
    config = json.loads(RELEASE.read_text())
    model = empty_model(config, torch.float32)
    ckpt = SimpleNamespace(tensors=release_index(model), manifest=None, quantization=quantization_of(config))
    print(f"{sum(map(len, ckpt.tensors.values())):,} tensors in {len(ckpt.tensors)} shards", flush=True)
    mode = "per_rank_mapping" if args.per_rank_mapping else "mapped_once"
    results = {}
    for ep in args.ep:
        start = time.process_time()
        read = plan_every_rank(ckpt, model, config, ep, not args.per_rank_mapping)
        results[ep] = time.process_time() - start
        print(f"EP={ep} ({mode}): {results[ep]:.1f} CPU-s, {results[ep] / ep:.2f} per rank; "
              f"{max(read) / 1e9:,.1f} GB read by the busiest rank", flush=True)
    print(f"RESULT mode={mode} " + " ".join(f"ep{ep}_cpu_s={s:.1f} ep{ep}_cpu_s_per_rank={s / ep:.2f}"
                                          for ep, s in results.items()))


if __name__ == "__main__":
    main()
