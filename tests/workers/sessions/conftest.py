import pytest
import torch

from moetune.api.models.lora import LoraSpec
from moetune.api.models.training import TrainingSpec
from moetune.workers.families import apply_kernel_swaps
from moetune.workers.model import trainable_model
from tests.workers.methods.test_dpo import random_lora_b


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    """The tiny checkpoint with its kernel swaps and LoRA, B nonzero: every LoRA A gets a gradient too."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    apply_kernel_swaps(base)
    torch.manual_seed(1)
    model = trainable_model(base, LoraSpec(rank=4, alpha=8, dropout=0.0), TrainingSpec(), None).train()
    random_lora_b(model)
    return model
