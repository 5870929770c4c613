"""The model a job trains: the streamed base (workers.weights), the family's kernel swaps (workers.families), PEFT
LoRA (workers.lora), then this rank's share of the experts (workers.parallel)."""

from __future__ import annotations

from moetune.api.errors import ErrorCode
from moetune.api.models import JobCreate
from moetune.workers.errors import JobError
from moetune.workers.families import family_for
from moetune.workers.lora.peft_lora import apply_lora
from moetune.workers.parallel import needs_expert_module, parallelize, quantized_experts
from moetune.workers.parallel.placement import ExpertPlacement
from moetune.workers.recompute import enable_activation_checkpointing


def load_tokenizer(local_dir: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    if tokenizer.eos_token_id is None:
        raise JobError(ErrorCode.invalid_model, "the model's tokenizer has no eos token", "model")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of loss and attention anyway
    return tokenizer


def load_dtype(device):
    """bf16 on GPUs, fp32 on CPU (where bf16 matmuls are slow)."""
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def trainable_model(model, spec: JobCreate, placement: ExpertPlacement | None):
    """PEFT LoRA, then (with expert parallelism or `train_experts`) this rank's share of the routed experts.

    Every rank must have drawn the same random state (LoRA init). `training.activation_checkpointing: true`
    checkpoints every decoder layer ("auto" is resolved to true or false before this is called)."""
    dtype = model.dtype  # the compute dtype: that of the dense weights (a quantized base keeps some: embeddings)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.use_cache = False  # training: no KV cache is built, none is kept
    peft_model = apply_lora(model, spec.lora)
    if placement is not None:
        family = family_for(model.config)
        if needs_expert_module(placement, spec.lora) or quantized_experts(model, family):
            parallelize(peft_model, family, placement, spec.lora, spec.training.custom_kernels)
    # PEFT puts a linear's LoRA in its weight's dtype; a quantized weight has no such dtype, so LoRA joins the
    # compute dtype here, like every other trainable tensor
    for param in peft_model.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)
    if spec.training.activation_checkpointing is True:
        enable_activation_checkpointing(peft_model)
    return peft_model
