"""Kimi-Linear (the seed family): KDA + MLA attention, sigmoid router with bias correction, a shared expert. With its
kernel swaps, micro-batches are packed: every layer keeps packed sequences apart (workers.families.segments)."""

from moetune.api.families import FAMILIES
from moetune.workers.families.kda import kda_swap
from moetune.workers.families.segments import segment_attention_swap
from moetune.workers.families.spec import Family
from moetune.workers.tiny import tiny_config as seed_config


def tiny_config(**overrides):
    config = seed_config(vocab_size=272, pad_id=256, bos_id=257, eos_id=258)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


FAMILY = Family(FAMILIES["kimi_linear"], moe_block="KimiLinearMoE", shared_experts="shared_experts",
                tiny_config=tiny_config,
                swaps=(kda_swap("KimiLinearDeltaAttention"), segment_attention_swap("KimiLinearAttention")))
