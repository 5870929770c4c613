"""What a job leaves behind: resumable checkpoints and the final PEFT adapter."""

from __future__ import annotations

import os


def save_adapter(engine, local_dir: str, is_writer: bool) -> None:
    """Writes the PEFT adapter (adapter_config.json + adapter_model.safetensors) from `is_writer`.

    Every rank must call this: under ZeRO-3 gathering the LoRA weights is a collective.
    """
    import deepspeed
    from peft import get_peft_model_state_dict

    peft_model = engine.module
    lora_params = [p for p in peft_model.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(lora_params, modifier_rank=None):
        if is_writer:
            state = {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
            peft_model.save_pretrained(local_dir, state_dict=state, safe_serialization=True)


def save_checkpoint(engine, local_dir: str, is_writer: bool) -> None:
    """DeepSpeed resume state (trainable weights + optimizer, per rank) and the adapter beside it."""
    engine.save_checkpoint(os.path.join(local_dir, "deepspeed"), exclude_frozen_parameters=True)
    save_adapter(engine, os.path.join(local_dir, "adapter"), is_writer)
