"""The memory and parallelism planner: builds a job's model on the meta device from config.json alone and computes
what one GPU holds (frozen weights, LoRA + gradients + optimizer state, activations, buffers) for each layout.

The tuner calls `starting_micro_batch` (its first size); the control plane runs `python -m moetune.workers.planner`,
whose plan of the submitted layout decides `activation_checkpointing: "auto"` (api.models.run_config)."""

from moetune.workers.planner.plan import plan
from moetune.workers.planner.start import starting_micro_batch

__all__ = ["plan", "starting_micro_batch"]
