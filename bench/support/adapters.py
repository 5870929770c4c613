"""PEFT adapters in moetune's export layout with random non-zero LoRA (linear only, or with expert LoRA), and the
tiny checkpoints they adapt: what the generation engine's tests and bench/serve.py serve."""

from __future__ import annotations

import torch

from bench.support.tiny_models import plain_model


def write_checkpoint(family_name: str, local_dir, config=None) -> str:
    """The family's tiny random model (`config`: another config of the family) and the tiny byte tokenizer."""
    from moetune.workers.families import REGISTRY
    from moetune.workers.tiny import write_tiny_tokenizer

    write_tiny_tokenizer(str(local_dir))
    model = plain_model(REGISTRY[family_name], config=config)
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 256, 257, 258
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 256, 258
    model.save_pretrained(str(local_dir), max_shard_size="200KB")
    return str(local_dir)


def write_adapter(family_name: str, local_dir, seed: int, experts: bool, rank: int = 4, config=None) -> str:
    """LoRA on every linear (as `target_modules: all-linear` trains), plus expert LoRA (`train_experts`) as
    `target_parameters` on the fused expert tensors, exported as moetune exports (loadable_adapter_config)."""
    from peft import get_peft_model

    from moetune.api.models.lora import LoraSpec
    from moetune.workers.families import REGISTRY
    from moetune.workers.families.spec import in_proj_name
    from moetune.workers.experts.lora_layout import loadable_adapter_config
    from moetune.workers.lora.peft_lora import _no_v4_target_conversion, apply_lora

    fam = REGISTRY[family_name]
    trained = apply_lora(plain_model(fam, config=config), LoraSpec(rank=rank, alpha=2.0 * rank, dropout=0.0))
    in_proj = in_proj_name(getattr(next(fam.moe_blocks(trained))[1], fam.experts)) if experts else None
    lora_config = loadable_adapter_config(trained.peft_config["default"], trained.config.model_type, in_proj)
    model = plain_model(fam, config=config)
    with _no_v4_target_conversion(model):
        adapted = get_peft_model(model, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    adapted.save_pretrained(str(local_dir))
    return str(local_dir)
