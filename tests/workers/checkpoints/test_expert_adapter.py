"""Expert LoRA without all experts in one place: each rank initialises only its own experts' A (the same values at
any EP size), and the adapter's all-expert tensors are written a slab at a time in PEFT's layout."""

from __future__ import annotations

import types

import torch
from safetensors.torch import load_file

from moetune.workers.experts import shards
from moetune.workers.checkpoints.safetensors_writer import SafetensorsWriter
from moetune.workers.families import REGISTRY
from moetune.workers.experts.lora_layout import peft_expert_state
from moetune.workers.experts.module import ExpertParallelExperts
from moetune.workers.experts.placement import placement_at
from bench.support.tiny_models import plain_model
from tests.support.allocations import Allocations

FAMILY = REGISTRY["kimi_linear"]


def _experts(placement, seed=0):
    model = plain_model(FAMILY)
    torch.manual_seed(seed)
    return [ExpertParallelExperts(getattr(block, FAMILY.experts), placement, lora_rank=4, lora_alpha=8)
            for _, block in FAMILY.moe_blocks(model)]


def test_each_rank_draws_only_its_experts_and_the_values_do_not_depend_on_ep():
    config = plain_model(FAMILY).config.to_dict()
    whole = _experts(placement_at(config, 1, 0))
    for rank in range(2):
        half = _experts(placement_at(config, 2, rank))
        for full, part in zip(whole, half, strict=True):
            assert part.lora_gate_up_a.shape[0] == full.num_experts // 2
            local = slice(4 * rank, 4 * rank + 4)
            assert torch.equal(part.lora_gate_up_a, full.lora_gate_up_a[local])
            assert torch.equal(part.lora_down_a, full.lora_down_a[local])
    assert not torch.equal(whole[0].lora_gate_up_a, whole[1].lora_gate_up_a)  # blocks draw their own seeds


def test_the_adapter_is_written_a_slab_at_a_time_in_peft_layout(tmp_path, monkeypatch):
    model = plain_model(FAMILY)
    config = model.config.to_dict()
    torch.manual_seed(0)
    for _, block in FAMILY.moe_blocks(model):
        setattr(block, FAMILY.experts, ExpertParallelExperts(getattr(block, FAMILY.experts),
                                                             placement_at(config, 1, 0), lora_rank=4, lora_alpha=8))
    for name, param in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(param)  # B too: every value must land in its place
    engine = types.SimpleNamespace(module=model)  # what the writer reads of a DeepSpeed engine
    monkeypatch.setattr(shards, "SLAB_BYTES", 512)  # several slabs per tensor even at this size
    entries = shards.expert_adapter_entries(engine.module)
    writer = SafetensorsWriter(str(tmp_path / "adapter.safetensors"), entries)
    with Allocations() as recorder:
        shards.write_expert_adapter(engine.module, writer)
    writer.close()
    written = load_file(str(tmp_path / "adapter.safetensors"))
    want = {}
    for name, module in shards.expert_modules(model):
        want.update(peft_expert_state(name, {n: p.detach() for n, p in module.named_parameters() if "lora_" in n}))
    assert written.keys() == want.keys() == entries.keys()
    for key, tensor in want.items():
        assert torch.equal(written[key], tensor), key
    largest_factor = max(t.numel() for t in want.values())
    assert 0 < recorder.largest <= 512 // 4 < largest_factor // 2, recorder.largest
