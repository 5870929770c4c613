"""Expert-LoRA state across ranks: per-rank shards in checkpoints, and the adapter's all-expert tensors written a
slab at a time.

Ranks that hold the same experts (a replica group) hold the same expert LoRA, so the first rank of each
replica group writes its EP rank's shard. Under ZeRO-3 a shard may be partitioned across its replica group;
it is gathered there first.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from moetune.workers.engine.deepspeed import full_shape, gathered, partitioned
from moetune.workers.comm import checked
from moetune.workers.experts.lora_layout import a_to_peft, expert_keys
from moetune.workers.experts.module import ExpertParallelExperts

EXPERT_DIR = "expert_lora"


def expert_modules(module) -> list[tuple[str, object]]:
    """(qualified name, module) of every expert-parallel experts module that carries LoRA."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, ExpertParallelExperts) and m.has_lora]


def _lora_params(module) -> dict:
    return {n: p for n, p in module.named_parameters(recurse=False) if n.startswith("lora_")}


def _local_shard(engine) -> dict:
    """This rank's expert LoRA, full local tensors, keyed `<module>.<factor>` (collective under ZeRO-3)."""
    shard = {}
    for name, module in expert_modules(engine.module):
        params = _lora_params(module)
        with gathered(params.values()):
            shard.update({f"{name}.{n}": p.detach().cpu().clone() for n, p in params.items()})
    return shard


def _shard_file(local_dir: str, ep, stage: int) -> str:
    # a pipeline stage's own names its stage (the first's keeps the name checkpoints had before stages)
    prefix = f"stage-{stage}-" if stage else ""
    return os.path.join(local_dir, EXPERT_DIR, f"{prefix}ep-{ep.ep_rank}-of-{ep.size}.safetensors")


def save_expert_shards(engine, local_dir: str, stage: int = 0) -> None:
    """Every rank calls this; one rank per replica group writes its EP rank's shard (of its pipeline `stage`)."""
    from safetensors.torch import save_file

    modules = expert_modules(engine.module)
    if not modules:
        return
    shard, ep = _local_shard(engine), modules[0][1].ep
    if dist.get_rank(group=ep.replica_group) == 0:
        os.makedirs(os.path.join(local_dir, EXPERT_DIR), exist_ok=True)
        save_file(shard, _shard_file(local_dir, ep, stage))


def restore_expert_shards(engine, local_dir: str, stage: int = 0) -> None:
    """After DeepSpeed's load: puts this rank's own expert LoRA back into the module and checks it.

    Under ZeRO-1/2 DeepSpeed restores each rank's fp32 master partition from that rank's optimizer file,
    but the module's weights from rank 0's model file: without this, every rank would run its first
    resumed step with rank 0's expert LoRA. (ZeRO-3 restores partitioned weights per rank.)
    """
    from safetensors.torch import load_file

    modules = expert_modules(engine.module)
    if not modules:
        return
    saved = load_file(_shard_file(local_dir, modules[0][1].ep, stage))
    with torch.no_grad():
        for name, module in modules:
            for factor, param in _lora_params(module).items():
                if not partitioned(param):  # ZeRO-3 restored partitioned weights per rank
                    param.copy_(saved[f"{name}.{factor}"])
    current = _local_shard(engine)
    if saved.keys() != current.keys() or any(not torch.equal(saved[k], current[k]) for k in saved):
        raise RuntimeError("resumed expert LoRA differs from this rank's saved shard")


SLAB_BYTES = 16 * 2**20  # what one rank sends the adapter's writer per collective


def _slabs(rows: int, row_bytes: int):
    step = max(1, SLAB_BYTES // max(1, row_bytes))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def _gather(slab, ep):
    """Every EP rank's `slab` on the EP group's first rank (in EP-rank order), None elsewhere; a collective."""
    if ep.size == 1:
        return [slab]
    first = dist.get_global_rank(ep.group, 0)
    slab = slab.contiguous()  # a permuted slab's empty_like would keep its strides: NCCL writes raw, dense bytes
    parts = [torch.empty_like(slab) for _ in range(ep.size)] if dist.get_rank() == first else None
    checked.gather(slab, parts, dst=first, group=ep.group)
    return parts


def expert_adapter_entries(model) -> dict:
    """PEFT adapter key -> (dtype, shape) of every expert-LoRA tensor of the PEFT `model`, all experts (see
    workers.experts.lora_layout); a pipeline stage's rank knows the other stages' from their meta tensors."""
    entries = {}
    for name, module in expert_modules(model):
        for a_name, b_name, key_a, key_b in expert_keys(name):
            a, b = getattr(module, a_name), getattr(module, b_name)
            (_, r, fan_in), (_, out, _) = (full_shape(p) for p in (a, b))
            entries[key_a] = (a.dtype, (module.num_experts * r, fan_in))  # (E·r, in), expert-major
            entries[key_b] = (b.dtype, (out, r * module.num_experts))  # (out, r·E), expert-minor
    return entries


def write_expert_adapter(model, writer, trained=None) -> None:
    """Streams all experts' LoRA of the PEFT `model` into `writer` (a SafetensorsWriter on the chief, a stage's
    relay, None elsewhere), a slab of rows at a time: no rank ever holds more than its own experts' factors plus one
    slab from each EP rank. Every rank calls it (the slabs travel by gather within each EP group, on the
    communication device); with `trained` (a pipeline stage's module), only the experts it holds."""
    held = {id(m) for m in (trained or model).modules()}
    for name, module in expert_modules(model):
        if id(module) not in held:
            continue
        ep, params = module.ep, _lora_params(module)
        with gathered(params.values()):
            for a_name, b_name, key_a, key_b in expert_keys(name):
                a = a_to_peft(params[a_name].detach())  # (E_local·r, in): rank k's rows follow rank k-1's
                for rows in _slabs(a.shape[0], a[0].nbytes):
                    parts = _gather(a[rows], ep)
                    for k, part in enumerate(parts if writer else ()):
                        writer.write(key_a, (k * a.shape[0] + rows.start) * a.shape[1], part)
                b = params[b_name].detach()  # (E_local, out, r); PEFT's row o is (r, E) with the experts fastest
                for rows in _slabs(b.shape[1], b.shape[0] * b[0, 0].nbytes):
                    parts = _gather(b[:, rows].permute(1, 2, 0), ep)  # (rows, r, E_local)
                    if writer:
                        writer.write(key_b, rows.start * b.shape[2] * module.num_experts, torch.cat(parts, -1))
