"""Kimi K3 (moetune's own model definition) against NeMo Automodel 0.7.0's reference, on tiny checkpoints the
reference writes in the release's naming: bf16, and with the routed experts in compressed-tensors'
mxfp4-pack-quantized per expert. Both models run in fp32 for the comparison (the reference in a child process)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from moetune.workers.families.kimi_k3 import TINY_TEXT, tiny_config
from tests.support.kimi_k3_reference import run_reference

# every linear both models hold as nn.Linear (the reference's routed experts are grouped parameters)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj", "q_a_proj",
                "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj",
                "routed_expert_down_proj", "routed_expert_up_proj"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("kimi-k3-reference"))
    ids = torch.randint(3, TINY_TEXT["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    request = {"seed": 0, "input_ids": ids.tolist(), "lora_targets": LORA_TARGETS, "text_config": TINY_TEXT}
    return workdir, ids, run_reference(workdir, request)


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _load(folder: str):
    from moetune.workers.families.kimi_k3.modeling import KimiK3ForConditionalGeneration

    return KimiK3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)


def test_layer_kinds_from_the_released_one_indexed_lists():
    text = tiny_config().text_config
    assert text.layer_types == ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    assert text.num_experts_per_tok == 2 and text.n_routed_experts == 8  # moetune's generic names
    released = type(text)()
    assert (released.layer_types.count("linear_attention"), released.layer_types.count("full_attention")) == (69, 24)


def test_a_variant_the_release_does_not_use_is_refused():
    from huggingface_hub.errors import StrictDataclassClassValidationError

    with pytest.raises(StrictDataclassClassValidationError, match="mla_use_nope"):
        tiny_config(mla_use_nope=False)


def test_checkpoint_is_in_the_released_naming(reference):
    workdir, _, _ = reference
    bf16, packed = _tensors(f"{workdir}/bf16"), _tensors(f"{workdir}/mxfp4")
    layer = "language_model.model.layers"
    assert f"{layer}.1.block_sparse_moe.experts.7.w2.weight" in bf16
    assert bf16[f"{layer}.0.self_attn.A_log"].shape == (128,)  # 4 heads, padded as released
    assert bf16[f"{layer}.0.self_attn.q_conv1d.weight"].shape == (64, 1, 4)
    assert {f"{layer}.3.block_sparse_moe.experts.0.w1.weight_packed", f"{layer}.3.block_sparse_moe.experts.0.w1."
            "weight_scale"} <= set(packed)
    assert packed[f"{layer}.3.block_sparse_moe.experts.0.w1.weight_packed"].dtype == torch.uint8
    assert "vision_tower" not in json.dumps(sorted(bf16))  # the tiny release is text-only (no tower built yet)


def test_loaded_state_dict_is_the_checkpoint(reference):
    """Every released tensor lands in moetune's model under its own name; the per-expert w1/w3/w2 become the fused
    experts (w1 rows, then w3 rows)."""
    workdir, _, _ = reference
    released = _tensors(f"{workdir}/bf16")
    ours = _load(f"{workdir}/bf16").state_dict()
    experts = "language_model.model.layers.2.block_sparse_moe.experts"
    fused = torch.stack([torch.cat((released[f"{experts}.{e}.w1.weight"], released[f"{experts}.{e}.w3.weight"]))
                         for e in range(8)])
    assert torch.equal(ours[f"{experts}.gate_up_proj"], fused.float())
    assert torch.equal(ours[f"{experts}.down_proj"],
                       torch.stack([released[f"{experts}.{e}.w2.weight"] for e in range(8)]).float())
    plain = {k: v for k, v in released.items() if ".experts." not in k}
    assert set(plain) == {k for k in ours if ".experts." not in k}
    assert all(torch.equal(ours[k], v.float()) for k, v in plain.items())


def _with_reference_lora(model, weights: dict[str, torch.Tensor]):
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    params = {n.removeprefix("base_model.model."): p for n, p in peft.named_parameters() if "lora_" in n}
    assert set(params) == set(weights)  # same LoRA modules under the same (released) names
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    return peft, params


@pytest.mark.parametrize("checkpoint", ["bf16"])
def test_logits_loss_and_lora_gradients_equal_the_reference(reference, checkpoint):
    workdir, ids, results = reference
    expected = results[checkpoint]
    model, lora = _with_reference_lora(_load(f"{workdir}/{checkpoint}"), expected["lora_weights"])
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.logits, expected["logits"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.loss, expected["loss"], rtol=1e-5, atol=1e-5)
    for name, grad in expected["lora_grads"].items():
        assert grad.abs().max() > 0, name  # every compared gradient carries signal
        torch.testing.assert_close(lora[name].grad, grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")
