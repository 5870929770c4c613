"""Training methods: how rows become examples, examples become micro-batches, and a forward becomes a loss.
Supervised fine-tuning is the first; a new method is one module here plus its name in `method_for`."""

from __future__ import annotations

from moetune.api.models import JobCreate
from moetune.workers.methods.sft import SupervisedMethod


def method_for(spec: JobCreate, tokenizer) -> SupervisedMethod:
    return SupervisedMethod(tokenizer, spec.training.seq_len)
