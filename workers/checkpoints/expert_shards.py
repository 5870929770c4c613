"""Expert-LoRA state across ranks: per-rank shards in checkpoints, and the all-expert gather for the adapter.

Ranks that hold the same experts (a replica group) hold the same expert LoRA, so the first rank of each
replica group writes its EP rank's shard. Under ZeRO-3 a shard may be partitioned across its replica group;
it is gathered there first.
"""

from __future__ import annotations

import os

from moetune.workers.lora.expert_layout import peft_expert_state
from moetune.workers.parallel.experts import ExpertParallelExperts

EXPERT_DIR = "expert_lora"


def expert_modules(module) -> list[tuple[str, object]]:
    """(qualified name, module) of every expert-parallel experts module that carries LoRA."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, ExpertParallelExperts) and m.lora_rank]


def _lora_params(module) -> dict:
    return {n: p for n, p in module.named_parameters(recurse=False) if n.startswith("lora_")}


def _local_shard(engine) -> dict:
    """This rank's expert LoRA, full local tensors, keyed `<module>.<factor>` (collective under ZeRO-3)."""
    import deepspeed

    shard = {}
    for name, module in expert_modules(engine.module):
        params = _lora_params(module)
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            shard.update({f"{name}.{n}": p.detach().cpu().clone() for n, p in params.items()})
    return shard


def _shard_file(local_dir: str, ep) -> str:
    return os.path.join(local_dir, EXPERT_DIR, f"ep-{ep.rank}-of-{ep.size}.safetensors")


def save_expert_shards(engine, local_dir: str) -> None:
    """Every rank calls this; one rank per replica group writes its EP rank's shard."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    modules = expert_modules(engine.module)
    if not modules:
        return
    shard, ep = _local_shard(engine), modules[0][1].ep
    if dist.get_rank(group=ep.replica_group) == 0:
        os.makedirs(os.path.join(local_dir, EXPERT_DIR), exist_ok=True)
        save_file(shard, _shard_file(local_dir, ep))


def restore_expert_shards(engine, local_dir: str) -> None:
    """After DeepSpeed's load: puts this rank's own expert LoRA back into the module and checks it.

    Under ZeRO-1/2 DeepSpeed restores each rank's fp32 master partition from that rank's optimizer file,
    but the module's weights from rank 0's model file: without this, every rank would run its first
    resumed step with rank 0's expert LoRA. (ZeRO-3 restores partitioned weights per rank.)
    """
    import torch
    from safetensors.torch import load_file

    modules = expert_modules(engine.module)
    if not modules:
        return
    saved = load_file(_shard_file(local_dir, modules[0][1].ep))
    with torch.no_grad():
        for name, module in modules:
            for factor, param in _lora_params(module).items():
                if not hasattr(param, "ds_id"):  # not a ZeRO-3 partitioned parameter
                    param.copy_(saved[f"{name}.{factor}"])
    current = _local_shard(engine)
    if saved.keys() != current.keys() or any(not torch.equal(saved[k], current[k]) for k in saved):
        raise RuntimeError("resumed expert LoRA differs from this rank's saved shard")


def gather_expert_adapter(engine) -> dict:
    """All experts' LoRA in PEFT's adapter layout (see workers.ep_adapter); a collective on every rank."""
    import torch
    import torch.distributed as dist

    state, shard = {}, _local_shard(engine)
    for name, module in expert_modules(engine.module):
        factors = {}
        for factor in _lora_params(module):
            local = shard[f"{name}.{factor}"]
            if module.ep.size > 1:
                parts = [torch.empty_like(local) for _ in range(module.ep.size)]
                dist.all_gather(parts, local.contiguous(), group=module.ep.group)
                local = torch.cat(parts)
            factors[factor] = local
        state.update(peft_expert_state(name, factors))
    return state
