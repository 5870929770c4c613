"""The vLLM side without vLLM: the Ray Serve LLM config moetune builds, and the expert-LoRA key layout moetune
exports read the way vLLM's 3D fused-MoE LoRA loader reads it (same per-expert update as PEFT applies)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moetune.workers.serve.vllm_config import engine_kind, llm_config, lora_id
from tests.support.families import plain_model
from tests.workers.generate.conftest import write_adapter


def test_llm_config_serves_loras_from_storage():
    config = llm_config("qwen3-moe", "s3://models/Qwen3-30B-A3B", "s3://outputs/runs/", max_loras=4,
                        max_lora_rank=16, tensor_parallel_size=2, expert_parallel=True, kv_offload_gb=32,
                        accelerator_type="H100")
    assert config["model_loading_config"] == {"model_id": "qwen3-moe",
                                              "model_source": {"bucket_uri": "s3://models/Qwen3-30B-A3B"}}
    assert config["llm_engine"] == "vLLM" and config["accelerator_type"] == "H100"
    assert config["engine_kwargs"] == {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16, "max_cpu_loras": 16,
                                       "tensor_parallel_size": 2, "enable_expert_parallel": True,
                                       "kv_offloading_size": 32, "kv_offloading_backend": "native"}
    assert config["lora_config"] == {"dynamic_lora_loading_path": "s3://outputs/runs", "max_num_adapters_per_replica": 4}
    # Ray Serve LLM's LoRA model id is "<base id>:<lora id>", loaded from <dynamic_lora_loading_path>/<lora id>
    assert lora_id("s3://outputs/runs/ftjob-1/adapter", "s3://outputs/runs/") == "ftjob-1/adapter"
    with pytest.raises(ValueError, match="not under the LoRA root"):
        lora_id("s3://elsewhere/ftjob-1/adapter", "s3://outputs/runs")
    with pytest.raises(ValueError):
        llm_config("b", "s3://m/b", "s3://o", max_loras=0)
    assert "kv_offloading_size" not in llm_config("b", "s3://m/b", "s3://o")["engine_kwargs"]


def test_engine_kind_is_vllm_only_on_a_gpu_for_a_family_it_serves_with_lora():
    assert engine_kind("qwen3_moe", gpus=1, vllm_installed=True) == "vllm"
    assert engine_kind("qwen3_moe", gpus=0, vllm_installed=True) == "moetune"
    assert engine_kind("qwen3_moe", gpus=1, vllm_installed=False) == "moetune"
    assert engine_kind("kimi_linear", gpus=8, vllm_installed=True) == "moetune"  # KDA layers: the moetune engine


def _vllm_3d_moe_factors(a: torch.Tensor, b: torch.Tensor, num_experts: int):
    """How vLLM's 3D fused-MoE LoRA loader reads PEFT's expert tensors: A (E·r, in) -> (E, r, in); B (out, r·E) ->
    (out, r, E) -> (E, out, r)."""
    return a.reshape(num_experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, num_experts).permute(2, 0, 1)


def test_moetune_expert_factors_export_as_vllm_reads_them():
    """workers/lora/expert_layout's export of per-expert factors (E, r, in) and (E, out, r), read back by vLLM's rule."""
    from moetune.workers.lora.expert_layout import peft_expert_state

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
