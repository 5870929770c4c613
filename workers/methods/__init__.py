"""Training methods: how rows become examples, examples become micro-batches, and a forward becomes a loss.
Supervised fine-tuning (sft, multimodal) and DPO (dpo); a new method is one module here plus its name in
`method_for`."""

from __future__ import annotations

import json
import os

from moetune.api.families import images_refusal, known_facts
from moetune.api.models.method import Method
from moetune.api.models.training import TrainingSpec
from moetune.api.preference import dpo_beta, method_type
from moetune.workers.methods.dpo import DpoMethod
from moetune.workers.methods.multimodal import ImageRows, SupervisedImageMethod
from moetune.workers.methods.sft import SupervisedMethod


def method_for(method: Method | None, training: TrainingSpec, tokenizer,
               model_dir: str | None = None) -> SupervisedMethod | DpoMethod:
    """DPO for method.type "dpo" (text rows only); else SFT, and on a checkpoint that takes images
    (api.families.images_refusal) SFT whose rows may carry them, through the processor files in `model_dir` (the
    downloaded model folder)."""
    if method_type(method) == "dpo":
        return DpoMethod(tokenizer, training.seq_len, dpo_beta(method.dpo))
    config = {}
    if model_dir and os.path.exists(path := os.path.join(model_dir, "config.json")):
        with open(path) as f:
            config = json.load(f)
    if config and images_refusal(config) is None:
        return SupervisedImageMethod(tokenizer, training.seq_len,
                                     ImageRows(model_dir, tokenizer, config[known_facts(config).image_token_key]))
    return SupervisedMethod(tokenizer, training.seq_len)
