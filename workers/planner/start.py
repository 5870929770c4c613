"""The tuner's first micro-batch size on a live model: the planner's bytes per sequence for the job's model (its
config.json read back from the model as built; LoRA, expert-parallel size and checkpointing from its run config)."""

from __future__ import annotations

from moetune.api.models.run_config import RunConfig


def sequence_bytes(model, job: RunConfig) -> float:
    """Planned bytes one more sequence of `training.seq_len` tokens adds: saved activations, the loss's logits
    and, with EP > 1, the all-to-all buffers."""
    from moetune.workers.planner.model import model_facts

    training, ep = job.training, job.parallelism.expert_parallel_size
    facts = model_facts(model.config.to_dict(), job, model.dtype)
    a2a = 2 * training.seq_len * facts.top_k * facts.expert_width * facts.compute_bytes if ep > 1 else 0
    return facts.activation_bytes(ep, training.activation_checkpointing) + facts.activations.loss + a2a


def starting_micro_batch(model, job: RunConfig, per_rank: int, free_bytes: float, sequences: int = 1) -> int:
    """The largest divisor of the per-rank batch whose planned activations fit `free_bytes` (1 if none does), each
    example running `sequences` sequences (DPO: 2)."""
    per_example = sequence_bytes(model, job) * sequences
    return max((m for m in range(1, per_rank + 1) if per_rank % m == 0 and m * per_example <= free_bytes),
               default=1)
