"""What a job leaves behind: resumable checkpoints and the final PEFT adapter."""

from __future__ import annotations

import os
from contextlib import contextmanager

from moetune.workers.checkpoints.expert_shards import (
    expert_adapter_entries,
    expert_modules,
    restore_expert_shards,
    save_expert_shards,
    write_expert_adapter,
)
from moetune.workers.checkpoints.safetensors_writer import SafetensorsWriter
from moetune.workers.lora.expert_layout import loadable_adapter_config


def save_adapter(engine, local_dir: str, is_writer: bool, base_model: str | None = None) -> None:
    """Writes the PEFT adapter (adapter_config.json + adapter_model.safetensors) from `is_writer`; the config's
    `base_model_name_or_path` is `base_model` (the job's base URI), which serving engines and PEFT read.

    Expert LoRA goes in as `target_parameters` on the fused expert tensors, streamed a slab at a time (no rank holds
    all experts' factors), and the config is one that PeftModel.from_pretrained on the plain transformers model
    loads as trained (see loadable_adapter_config). Every rank must call this: gathering is a collective.
    """
    import deepspeed
    from peft import get_peft_model_state_dict

    peft_model = engine.module
    lora_params = [p for p in peft_model.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(lora_params, modifier_rank=None):
        # PEFT picks every key containing "lora_", the expert factors included: those go in PEFT's layout instead.
        state = {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(peft_model).items()
                 if ".experts.lora_" not in k} if is_writer else {}
    experts = expert_adapter_entries(engine)
    writer = None
    if is_writer:
        in_proj = next((m.in_proj for _, m in expert_modules(engine.module)), None) if experts else None
        config = loadable_adapter_config(peft_model.peft_config["default"], peft_model.config.model_type, in_proj)
        config.base_model_name_or_path = base_model
        os.makedirs(local_dir, exist_ok=True)
        config.save_pretrained(local_dir)
        writer = SafetensorsWriter(os.path.join(local_dir, "adapter_model.safetensors"),
                                   {**{k: (v.dtype, tuple(v.shape)) for k, v in state.items()}, **experts})
        for key, value in state.items():
            writer.write(key, 0, value)
    try:
        write_expert_adapter(engine, writer)
    finally:
        if writer:
            writer.close()


@contextmanager
def _without_deepspeed_moe_checkpointing(engine):
    """DeepSpeed's MoE checkpoint path expects its own AutoEP layer layout (experts.w1/w2/w3) and would write
    rank 0's experts for everyone. Our frozen experts are not saved at all (they come from the model), ZeRO's
    per-rank optimizer files already hold each rank's own expert LoRA, and we add per-rank expert shards."""
    has_moe = engine.has_moe_layers
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = has_moe


def save_checkpoint(engine, local_dir: str, is_writer: bool, base_model: str | None = None) -> None:
    """DeepSpeed resume state (trainable weights + optimizer, per rank), expert-LoRA shards, and the adapter."""
    with _without_deepspeed_moe_checkpointing(engine):
        engine.save_checkpoint(os.path.join(local_dir, "deepspeed"), exclude_frozen_parameters=True)
    save_expert_shards(engine, local_dir)
    save_adapter(engine, os.path.join(local_dir, "adapter"), is_writer, base_model)


def load_checkpoint(engine, local_dir: str) -> None:
    """Restores what save_checkpoint wrote (weights, optimizer, LR schedule); every rank calls it."""
    with _without_deepspeed_moe_checkpointing(engine):
        path, _ = engine.load_checkpoint(os.path.join(local_dir, "deepspeed"), load_module_strict=False)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint under {local_dir}")
    restore_expert_shards(engine, local_dir)
