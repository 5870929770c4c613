"""What a job leaves behind: resumable checkpoints and the final PEFT adapter."""

from __future__ import annotations

import os

from moetune.workers.checkpoints.safetensors_writer import SafetensorsWriter
from moetune.workers.engine.deepspeed import gathered, load_state, save_state
from moetune.workers.experts.lora_layout import loadable_adapter_config
from moetune.workers.experts.shards import (
    expert_adapter_entries,
    expert_modules,
    restore_expert_shards,
    save_expert_shards,
    write_expert_adapter,
)


def save_adapter(engine, local_dir: str, is_writer: bool, base_model: str | None = None) -> None:
    """Writes the PEFT adapter (adapter_config.json + adapter_model.safetensors) from `is_writer`; the config's
    `base_model_name_or_path` is `base_model` (the job's base URI), which serving engines and PEFT read.

    Expert LoRA goes in as `target_parameters` on the fused expert tensors, streamed a slab at a time (no rank holds
    all experts' factors), and the config is one that PeftModel.from_pretrained on the plain transformers model
    loads as trained (see loadable_adapter_config). Every rank must call this: gathering is a collective.
    """
    from peft import get_peft_model_state_dict

    peft_model = engine.module
    lora_params = [p for p in peft_model.parameters() if p.requires_grad]
    with gathered(lora_params):
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


def save_checkpoint(engine, local_dir: str, is_writer: bool, base_model: str | None = None) -> None:
    """DeepSpeed resume state (trainable weights + optimizer, per rank), expert-LoRA shards, and the adapter."""
    save_state(engine, os.path.join(local_dir, "deepspeed"))
    save_expert_shards(engine, local_dir)
    save_adapter(engine, os.path.join(local_dir, "adapter"), is_writer, base_model)


def load_checkpoint(engine, local_dir: str) -> None:
    """Restores what save_checkpoint wrote (weights, optimizer, LR schedule); every rank calls it."""
    if not load_state(engine, os.path.join(local_dir, "deepspeed")):
        raise FileNotFoundError(f"no DeepSpeed checkpoint under {local_dir}")
    restore_expert_shards(engine, local_dir)
