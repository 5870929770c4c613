"""The tuner's first micro-batch size on a live model: the planner's bytes per sequence for the job's model (its
config.json read back from the model as built; LoRA, expert-parallel size and checkpointing from its run config)."""

from __future__ import annotations

from moetune.api.models.run_config import RunConfig


def sequence_bytes(model, job: RunConfig) -> float:
    """Planned bytes one more sequence of `training.seq_len` tokens adds on this rank (its slice with context
    parallelism): saved activations, the loss's logits and, with EP > 1, the all-to-all buffers."""
    from moetune.workers.planner.model import model_facts

    par = job.parallelism
    ep, cp = par.expert_parallel_size, par.context_parallel_size
    device_type = "cuda" if par.gpus_per_worker else "cpu"  # not the model's: a pipeline stage's rank holds some
    facts = model_facts(model.config.to_dict(), job, model.dtype, device_type)
    return (facts.activation_bytes(ep, job.training.activation_checkpointing, cp) + facts.loss_bytes(cp)
            + facts.all_to_all_bytes(ep, cp))


def starting_micro_batch(model, job: RunConfig, per_rank: int, free_bytes: float, sequences: int = 1) -> int:
    """The largest divisor of the per-rank batch whose planned activations fit `free_bytes` (1 if none does), each
    example running `sequences` sequences (DPO: 2)."""
    per_example = sequence_bytes(model, job) * sequences
    return max((m for m in range(1, per_rank + 1) if per_rank % m == 0 and m * per_example <= free_bytes),
               default=1)
