"""Submission limits on values that are valid but absurd: `max_steps` x `global_batch_size` against the training
file's size (a 422 beyond MOETUNE_MAX_EPOCHS passes), and warnings about a learning-rate schedule that will not do
what its numbers suggest (events on the new job). The step count and LR multipliers are the workers' own
(api/lr_schedule.py)."""

from __future__ import annotations

from moetune.api.lr_schedule import lr_factor, total_steps, warmup_steps
from moetune.api.models.base import SpecError
from moetune.api.models.training import TrainingSpec

_FIRST_STEP_LR_FLOOR = 0.01  # a first step at under 1% of learning_rate: the warm-up is the whole story


def check_epochs(t: TrainingSpec, training_rows: int | None, max_epochs: float) -> None:
    """SpecError (param training.max_steps) when max_steps runs more than `max_epochs` passes over the rows."""
    if t.max_steps is None or not training_rows or t.allow_many_epochs:
        return
    epochs = t.max_steps * t.global_batch_size / training_rows
    if epochs > max_epochs:
        raise SpecError("training.max_steps",
                        f"training.max_steps: {t.max_steps} steps x global_batch_size {t.global_batch_size} make "
                        f"{epochs:.3g} passes over the {training_rows} rows of training_file, over this server's "
                        f"limit of {max_epochs:g}; lower max_steps (or use n_epochs), or set "
                        f"training.allow_many_epochs: true if it is meant")


def schedule_warnings(t: TrainingSpec, training_rows: int | None) -> list[str]:
    """What the job's learning-rate schedule will do that its numbers may not suggest (empty: nothing)."""
    if t.max_steps is None and not training_rows:
        return []  # the step count is only known from the rows
    steps = total_steps(training_rows or 0, t.global_batch_size, t.max_steps, t.n_epochs)
    warmup = warmup_steps(steps, t.warmup_ratio)
    warnings = []
    if warmup >= steps > 1:  # (one step at half the rate is what a 1-step job with any warm-up gets)
        warnings.append(f"training.warmup_ratio: the warm-up lasts all {steps} steps: the learning rate never "
                        f"reaches training.learning_rate ({t.learning_rate:g})")
    elif (first := lr_factor(0, steps, t.warmup_ratio, t.lr_scheduler)) < _FIRST_STEP_LR_FLOOR:
        warnings.append(f"training.warmup_ratio: the warm-up lasts {warmup} of {steps} steps; step 1 runs at a "
                        f"learning rate of {t.learning_rate * first:.2g} ({first:.2g} x training.learning_rate)")
    return warnings
