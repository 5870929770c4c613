"""The tuner's first micro-batch size on a live model: the planner's bytes per sequence for the model as the
workers built it (its config, LoRA, expert-parallel size and checkpointing read back from the model)."""

from __future__ import annotations

from moetune.api.models.job_create import JobCreate
from moetune.api.models.training import TrainingSpec
from moetune.workers.experts.module import ExpertParallelExperts
from moetune.workers.lora.peft_lora import lora_spec_of


def _job_of(model, training: TrainingSpec) -> tuple[dict, JobCreate, int, bool]:
    """(config.json dict, the job's spec as far as memory goes, EP size, checkpointing) of a trainable model."""
    expert_modules = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    lora = lora_spec_of(model.peft_config["default"], any(m.has_lora for m in expert_modules))
    spec = JobCreate(model="file:///unused", training_file="file:///unused", training=training, lora=lora)
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    ep = expert_modules[0].ep.size if expert_modules else 1
    return model.config.to_dict(), spec, ep, checkpointing


def sequence_bytes(model, training: TrainingSpec) -> float:
    """Planned bytes one more sequence of `training.seq_len` tokens adds: saved activations, the loss's logits
    and, with EP > 1, the all-to-all buffers."""
    from moetune.workers.planner.model import model_facts

    config, spec, ep, checkpointing = _job_of(model, training)
    facts = model_facts(config, spec, model.dtype)
    a2a = 2 * training.seq_len * facts.top_k * facts.expert_width * facts.compute_bytes if ep > 1 else 0
    return facts.activation_bytes(ep, checkpointing) + facts.activations.loss + a2a


def starting_micro_batch(model, training: TrainingSpec, per_rank: int, free_bytes: float, sequences: int = 1) -> int:
    """The largest divisor of the per-rank batch whose planned activations fit `free_bytes` (1 if none does), each
    example running `sequences` sequences (DPO: 2)."""
    per_example = sequence_bytes(model, training) * sequences
    return max((m for m in range(1, per_rank + 1) if per_rank % m == 0 and m * per_example <= free_bytes),
               default=1)
