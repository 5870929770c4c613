"""Tiny checkpoints of two families (kimi_linear: KDA + MLA; qwen3_moe: softmax attention with RoPE) and PEFT
adapters in moetune's export layout with random non-zero LoRA, linear only or with expert LoRA."""

from __future__ import annotations

import pytest
import torch

from tests.support.families import plain_model

FAMILIES = ("kimi_linear", "qwen3_moe")


def write_checkpoint(family_name: str, local_dir) -> str:
    from moetune.workers.families import REGISTRY
    from moetune.workers.tiny import write_tiny_tokenizer

    write_tiny_tokenizer(str(local_dir))
    model = plain_model(REGISTRY[family_name])
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 256, 257, 258
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 256, 258
    model.save_pretrained(str(local_dir), max_shard_size="200KB")
    return str(local_dir)


def write_adapter(family_name: str, local_dir, seed: int, experts: bool, rank: int = 4) -> str:
    """LoRA on every linear (as `target_modules: all-linear` trains), plus expert LoRA (`train_experts`) as
    `target_parameters` on the fused expert tensors, exported as moetune exports (loadable_adapter_config)."""
    from peft import get_peft_model

    from moetune.api.models import LoraSpec
    from moetune.workers.families import REGISTRY
    from moetune.workers.families.spec import in_proj_name
    from moetune.workers.lora.expert_layout import loadable_adapter_config
    from moetune.workers.lora.peft_lora import _no_v4_target_conversion, apply_lora

    fam = REGISTRY[family_name]
    trained = apply_lora(plain_model(fam), LoraSpec(rank=rank, alpha=2.0 * rank, dropout=0.0))
    in_proj = in_proj_name(getattr(next(fam.moe_blocks(trained))[1], fam.experts)) if experts else None
    config = loadable_adapter_config(trained.peft_config["default"], trained.config.model_type, in_proj)
    model = plain_model(fam)
    with _no_v4_target_conversion(model):
        adapted = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    adapted.save_pretrained(str(local_dir))
    return str(local_dir)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: write_checkpoint(name, tmp_path_factory.mktemp(f"ckpt-{name}")) for name in FAMILIES}


@pytest.fixture(scope="session")
def adapters(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(family, "linear" | "experts" | "linear-2" | "experts-2") -> adapter dir."""
    out = {}
    for name in FAMILIES:
        for kind, seed, experts in (("linear", 1, False), ("experts", 2, True), ("linear-2", 3, False),
                                    ("experts-2", 4, True)):
            out[name, kind] = write_adapter(name, tmp_path_factory.mktemp(f"adapter-{name}-{kind}"), seed, experts)
    return out
