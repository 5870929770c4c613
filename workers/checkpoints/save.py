"""What a job leaves behind: resumable checkpoints and the final PEFT adapter."""

from __future__ import annotations

import os

from moetune.workers.checkpoints.safetensors_writer import SafetensorsWriter
from moetune.workers.checkpoints.stage_relay import PipelinedModel, StageRelay, receive_stages
from moetune.workers.engine.deepspeed import full_shape, gathered, load_state, save_state
from moetune.workers.experts.lora_layout import loadable_adapter_config
from moetune.workers.experts.shards import (
    expert_adapter_entries,
    expert_modules,
    restore_expert_shards,
    save_expert_shards,
    write_expert_adapter,
)


def save_adapter(engine, local_dir: str, is_writer: bool, base_model: str | None = None,
                 pipelined: PipelinedModel | None = None) -> None:
    """Writes the PEFT adapter (adapter_config.json + adapter_model.safetensors) from `is_writer`; the config's
    `base_model_name_or_path` is `base_model` (the job's base URI), which serving engines and PEFT read.

    Expert LoRA goes in as `target_parameters` on the fused expert tensors, streamed a slab at a time (no rank holds
    all experts' factors), and the config is one that PeftModel.from_pretrained on the plain transformers model
    loads as trained (see loadable_adapter_config). Every rank must call this: gathering is a collective. With
    pipeline stages (`pipelined`) `engine` is the rank's stage's and each stage's first rank relays its share to
    the writer (workers.checkpoints.stage_relay): one adapter, as without stages.
    """
    from peft import get_peft_model_state_dict

    peft_model = pipelined.model if pipelined else engine.module
    stage_writer = pipelined.stage_writer if pipelined else is_writer
    lora_params = [p for p in engine.module.parameters() if p.requires_grad]
    mine = {id(p) for p in lora_params}  # a stage's rank writes what its stage trains, whatever else it holds
    with gathered(lora_params):
        # PEFT picks every key containing "lora_", the expert factors included: those go in PEFT's layout instead.
        whole = {k: v for k, v in get_peft_model_state_dict(
            peft_model, state_dict=peft_model.state_dict(keep_vars=True)).items() if ".experts.lora_" not in k}
        state = {k: v.detach().cpu().clone() for k, v in whole.items() if id(v) in mine} if stage_writer else {}
    writer = None
    if is_writer:
        experts = expert_adapter_entries(peft_model)
        in_proj = next((m.in_proj for _, m in expert_modules(peft_model)), None) if experts else None
        config = loadable_adapter_config(peft_model.peft_config["default"], peft_model.config.model_type, in_proj)
        config.base_model_name_or_path = base_model
        os.makedirs(local_dir, exist_ok=True)
        config.save_pretrained(local_dir)
        writer = SafetensorsWriter(os.path.join(local_dir, "adapter_model.safetensors"),
                                   {**{k: (v.dtype, full_shape(v)) for k, v in whole.items()}, **experts})
    elif stage_writer:
        writer = StageRelay(pipelined.first_ranks[0])
    try:
        for key, value in state.items():
            writer.write(key, 0, value)
        write_expert_adapter(peft_model, writer, engine.module)
        if is_writer and pipelined:
            receive_stages(writer, pipelined.first_ranks[1:])
    finally:
        if writer:
            writer.close()


def save_checkpoint(engine, local_dir: str, is_writer: bool, base_model: str | None = None,
                    pipelined: PipelinedModel | None = None) -> None:
    """DeepSpeed resume state (trainable weights + optimizer, per rank; a stage's engine its own files), expert-LoRA
    shards, and the adapter."""
    save_state(engine, os.path.join(local_dir, "deepspeed"))
    save_expert_shards(engine, local_dir, pipelined.stage if pipelined else 0)
    save_adapter(engine, os.path.join(local_dir, "adapter"), is_writer, base_model, pipelined)


def load_checkpoint(engine, local_dir: str, stage: int = 0) -> None:
    """Restores what save_checkpoint wrote (weights, optimizer, LR schedule); every rank calls it (`stage`: its
    pipeline stage's)."""
    if not load_state(engine, os.path.join(local_dir, "deepspeed")):
        raise FileNotFoundError(f"no DeepSpeed checkpoint under {local_dir}")
    restore_expert_shards(engine, local_dir, stage)
