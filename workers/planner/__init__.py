"""The memory and parallelism planner: builds a job's model on the meta device from config.json alone and computes
what one GPU holds (frozen weights, LoRA + gradients + optimizer state, activations, buffers) for each layout.

Workers call `needs_activation_checkpointing` (to resolve `training.activation_checkpointing: "auto"`) and
`starting_micro_batch` (the tuner's first size); the control plane runs `python -m moetune.workers.planner`."""

from moetune.workers.planner.plan import needs_activation_checkpointing, plan
from moetune.workers.planner.start import starting_micro_batch

__all__ = ["needs_activation_checkpointing", "plan", "starting_micro_batch"]
