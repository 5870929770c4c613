"""The expert-LoRA key layout moetune exports, read the way vLLM's 3D fused-MoE LoRA loader reads it: the same
per-expert update as PEFT's own merge applies (PEFT is the reference; vLLM is not installed here)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from bench.support.tiny_models import plain_model
from tests.workers.generate.conftest import write_adapter


def _vllm_3d_moe_factors(a: torch.Tensor, b: torch.Tensor, num_experts: int):
    """How vLLM's 3D fused-MoE LoRA loader reads PEFT's expert tensors: A (E·r, in) -> (E, r, in); B (out, r·E) ->
    (out, r, E) -> (E, out, r)."""
    return a.reshape(num_experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, num_experts).permute(2, 0, 1)


def test_moetune_expert_factors_export_as_vllm_reads_them():
    """workers/experts/lora_layout's export of per-expert factors (E, r, in) and (E, out, r), read back by vLLM's rule."""
    from moetune.workers.experts.lora_layout import peft_expert_state

    generator = torch.Generator().manual_seed(0)
    factors = {"lora_gate_up_a": torch.randn(4, 2, 8, generator=generator),
               "lora_gate_up_b": torch.randn(4, 12, 2, generator=generator),
               "lora_down_a": torch.randn(4, 2, 6, generator=generator),
               "lora_down_b": torch.randn(4, 8, 2, generator=generator)}
    state = peft_expert_state("model.layers.0.mlp.experts", factors)
    for infix, name in (("base_layer.", "gate_up"), ("", "down")):
        a, b = _vllm_3d_moe_factors(state[f"model.layers.0.mlp.experts.{infix}lora_A.weight"],
                                    state[f"model.layers.0.mlp.experts.{infix}lora_B.weight"], 4)
        assert torch.equal(a, factors[f"lora_{name}_a"]) and torch.equal(b, factors[f"lora_{name}_b"])


def test_the_exported_expert_layout_is_the_one_vllm_reads(tmp_path):
    from peft import PeftModel

    from moetune.workers.families import REGISTRY

    family = REGISTRY["qwen3_moe"]
    adapter = write_adapter("qwen3_moe", tmp_path / "adapter", seed=5, experts=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    state = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    prefix = next(k for k in state if k.endswith(".experts.base_layer.lora_A.weight")).removesuffix(
        ".base_layer.lora_A.weight")
    # vLLM's PEFT-format rule: `experts.base_layer` holds gate_up_proj's LoRA, `experts` holds down_proj's
    gate_up = (state[f"{prefix}.base_layer.lora_A.weight"], state[f"{prefix}.base_layer.lora_B.weight"])
    down = (state[f"{prefix}.lora_A.weight"], state[f"{prefix}.lora_B.weight"])

    base = plain_model(family)
    experts_name = prefix.removeprefix("base_model.model.")
    before = {n: p.detach().clone() for n, p in base.named_parameters() if n.startswith(experts_name)}
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()  # `before` holds the base's copy
    after = dict(merged.named_parameters())
    scaling = config["lora_alpha"] / config["r"]
    for (a, b), tensor in ((gate_up, "gate_up_proj"), (down, "down_proj")):
        delta = after[f"{experts_name}.{tensor}"] - before[f"{experts_name}.{tensor}"]  # (E, out, in)
        lora_a, lora_b = _vllm_3d_moe_factors(a, b, delta.shape[0])
        assert torch.allclose(scaling * lora_b @ lora_a, delta, atol=1e-5), tensor
