"""Expert parallelism, in one room: which routed experts a rank holds (`placement`), the expert-parallel module that
replaces a family's experts (`module`: its grouped compute, `compute`, and its token all-to-all, `alltoall` over
`comm`'s checked collectives), expert LoRA in PEFT's adapter layout with the one LoRA scaling rule (`lora_layout`),
its per-rank shards in checkpoints and its slab-wise export (`shards`), and its per-row adapter slots when serving
(`serving_slots`). What DeepSpeed must know of it is said in workers.engine.experts; ZeRO handles everything else.

`parallelize` puts each rank's share of the routed experts (an `ExpertPlacement`) into the expert-parallel module."""

from __future__ import annotations

from moetune.api.models import JobCreate, LoraSpec
from moetune.kernels.quant import held_names
from moetune.workers.experts.module import ExpertParallelExperts, trainable_experts_class
from moetune.workers.experts.placement import ExpertPlacement, expert_placement, placement_at
from moetune.workers.families.spec import Family


def needs_expert_module(placement: ExpertPlacement | None, lora: LoraSpec | None) -> bool:
    """Whether the routed experts need the expert-parallel module's process groups: they are sharded, or they get
    their own LoRA."""
    return placement is not None and (placement.sharded or (lora is not None and lora.train_experts))


def quantized_experts(model, family: Family) -> bool:
    """Whether the loader left the frozen experts quantized (transformers' experts module cannot run them)."""
    return any(held_names(getattr(block, family.experts)) for _, block in family.moe_blocks(model))


def job_placement(config: dict, spec: JobCreate) -> ExpertPlacement | None:
    """This rank's placement for a job on the model of `config` (torch.distributed up); DeepSpeed's expert process
    groups are made only where the experts leave transformers' module."""
    size = spec.parallelism.expert_parallel_size
    single = placement_at(config, size, 0)
    return expert_placement(config, size) if needs_expert_module(single, spec.lora) else single


def expert_parallel(experts, family: Family, placement: ExpertPlacement, lora: LoraSpec | None,
                    fused_kernel: bool = True):
    """The expert-parallel module that takes this rank's share of one MoE block's `experts`, with per-expert LoRA
    when `lora.train_experts` (frozen experts without `lora`). `fused_kernel`: the local experts run kernels.moe's
    grouped GEMMs, else a per-expert loop (see experts.compute)."""
    rank = lora.rank if lora is not None and lora.train_experts else 0
    cls = trainable_experts_class() if rank else ExpertParallelExperts
    activation = family.expert_activation(experts) if family.expert_activation else None
    return cls(experts, placement, rank, lora.alpha if lora is not None else 1.0, fused_kernel, activation)


def parallelize(model, family: Family, placement: ExpertPlacement, lora: LoraSpec | None,
                fused_kernel: bool = True) -> int:
    """Replaces the routed experts of every MoE block of `model` by `expert_parallel`; returns how many blocks
    changed."""
    blocks = list(family.moe_blocks(model))
    for _, block in blocks:
        setattr(block, family.experts, expert_parallel(getattr(block, family.experts), family, placement, lora,
                                                       fused_kernel))
    return len(blocks)
