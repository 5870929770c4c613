"""The DeepSpeed ZeRO engine over the LoRA model: its configuration, its parameters whole for a moment, its resume
state."""

from __future__ import annotations

from contextlib import contextmanager

from moetune.api.models.parallelism import ParallelDims
from moetune.api.models.run_config import RunTraining
from moetune.workers.comm.lockstep import hold_in_lockstep
from moetune.workers.engine.schedule import lr_scheduler


def deepspeed_batch_size(global_batch_size: int, parallelism: ParallelDims) -> int:
    """The batch DeepSpeed counts in an optimizer step. It takes every rank of its group (the stage's, with
    pipeline stages) for a data-parallel one, while the ranks of a context-parallel group run the same examples,
    each its slice: to DeepSpeed the global batch is seen once per rank of a data-parallel replica. Only its
    bookkeeping reads it: StepRunner marks the accumulation boundary and scales the loss itself."""
    return global_batch_size * (parallelism.stage_size // parallelism.data_parallel_size)


def deepspeed_config(t: RunTraining, parallelism: ParallelDims, world_size: int, bf16: bool) -> dict:
    micro_batch_size = t.micro_batch_size  # tuned: the tuner's start, which StepRunner sets
    batch_size = deepspeed_batch_size(t.global_batch_size, parallelism)
    group = world_size // parallelism.pipeline_parallel_size  # DeepSpeed's data-parallel group: a stage's ranks
    return {
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": batch_size // (micro_batch_size * group),
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": parallelism.zero_stage},
        "bf16": {"enabled": bf16},
        # bf16 compute, fp32 gradients: accumulated over micro-batches (ZeRO-1's bf16 optimizer reads this) and
        # reduced across ranks in fp32 (DeepSpeed's default follows the model's bf16). LoRA gradients are small.
        **({"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"} if bf16 else {}),
        # The client optimizer is plain torch AdamW: DeepSpeed's CPU Adam needs a compiled extension.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # progress goes to the control plane, not stdout
    }


def init_comm() -> None:
    """DeepSpeed's communication over the torch.distributed group already up (once; its config reads the world
    size from it)."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def _param_groups(model) -> list[dict]:
    """Trainable parameters; expert-parallel ones (expert LoRA) in their own groups, which DeepSpeed reduces
    only across the ranks holding the same experts."""
    from deepspeed.moe.utils import (
        is_moe_param,
        split_params_into_different_moe_groups_for_optimizer,
    )

    group = {"params": [p for p in model.parameters() if p.requires_grad], "name": "lora"}
    if not any(is_moe_param(p) for p in group["params"]):
        return [group]
    return [g for g in split_params_into_different_moe_groups_for_optimizer(group) if g["params"]]


def build_engine(model, training: RunTraining, parallelism: ParallelDims, world_size: int, total_steps: int,
                 bf16: bool, groups=None):
    """Returns (engine, lr_scheduler) for the job's `training` and `parallelism` sections; DeepSpeed steps the
    scheduler at every optimizer step. `groups`: a pipeline stage's (engine.pipeline.StageGroups)."""
    import deepspeed
    import torch

    optimizer = torch.optim.AdamW(_param_groups(model), lr=training.learning_rate, weight_decay=0.0)
    scheduler = lr_scheduler(optimizer, total_steps, training.warmup_ratio, training.lr_scheduler)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(training, parallelism, world_size, bf16),
        mpu=groups,
    )
    # every module with partitioned weights below it: a parent may read a child's weight without calling the child
    # (a vision tower's position embeddings), and DeepSpeed gathers it then
    hold_in_lockstep([(name, m) for name, m in engine.module.named_modules()
                      if any(partitioned(p) for p in m.parameters())])
    return engine, scheduler


def set_micro_batch_size(engine, micro_batch_size: int, global_batch_size: int, parallelism: ParallelDims) -> None:
    """Keeps DeepSpeed's batch bookkeeping (samples counted, saved config) in step with a tuner decision;
    the global batch stays the same, gradient accumulation absorbs the change."""
    engine.set_train_micro_batch_size(micro_batch_size)
    engine.set_train_batch_size(deepspeed_batch_size(global_batch_size, parallelism))


def gathered(params):
    """A context in which ZeRO-3's partitioned `params` are whole on every rank (read only; no-op for others)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)


def partitioned(param) -> bool:
    """Whether ZeRO-3 partitioned `param` (its own checkpoint files restore it per rank)."""
    return hasattr(param, "ds_id")


def full_shape(param) -> tuple:
    """The shape of `param` before ZeRO-3 partitioned it."""
    return tuple(getattr(param, "ds_shape", param.shape))


@contextmanager
def _without_moe_checkpointing(engine):
    """DeepSpeed's MoE checkpoint path expects its own AutoEP layer layout (experts.w1/w2/w3) and would write
    rank 0's experts for everyone. Our frozen experts are not saved at all (they come from the model), ZeRO's
    per-rank optimizer files already hold each rank's own expert LoRA, and workers.experts.shards adds per-rank
    expert shards."""
    has_moe = engine.has_moe_layers
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = has_moe


def save_state(engine, path: str) -> None:
    """DeepSpeed's resume state under `path`: trainable weights and optimizer, per rank (frozen weights left out)."""
    with _without_moe_checkpointing(engine):
        engine.save_checkpoint(path, exclude_frozen_parameters=True)


def load_state(engine, path: str) -> bool:
    """Restores what save_state wrote (weights, optimizer, LR schedule); False when `path` holds none. Every rank
    calls it."""
    with _without_moe_checkpointing(engine):
        loaded, _ = engine.load_checkpoint(path, load_module_strict=False)
    return loaded is not None
