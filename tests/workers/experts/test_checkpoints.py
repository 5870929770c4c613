"""Per-rank checkpoints with exact resume, and the exported adapter on the plain transformers model, per family
(and on a released quantized checkpoint, dequantized, with and without expert LoRA)."""

import os

import pytest
import torch

from bench.support.tiny_models import batch, plain_model
from tests.workers.experts.cases import RELEASED_CASES, RESUME_CASES
from bench.support.harness import SAVE_AFTER, base_model


@pytest.mark.parametrize("case", list(RESUME_CASES) + list(RELEASED_CASES))
def test_resume_is_exact_and_adapter_loads_into_peft(ep_runs, case):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    from moetune.workers.families import REGISTRY

    family, job = {**RESUME_CASES, **RELEASED_CASES}[case]
    fam = REGISTRY[family]
    out, ranks = ep_runs(case)
    for r in ranks:
        assert r["resumed"] == r["losses"][SAVE_AFTER:]  # bit-exact
    expert_lora = job.lora.train_experts
    if expert_lora:
        assert sorted(os.listdir(out / "ckpt" / "expert_lora")) == ["ep-0-of-2.safetensors", "ep-1-of-2.safetensors"]
    else:  # only DeepSpeed's state: the frozen experts are the base's
        assert not (out / "ckpt" / "expert_lora").exists()

    plain = base_model(str(out / "base")) if case in RELEASED_CASES else plain_model(fam)
    model = PeftModel.from_pretrained(plain, str(out / "adapter")).eval()
    # every adapter tensor has its place in the plain model, and every LoRA tensor there is in the file
    assert load_file(str(out / "adapter" / "adapter_model.safetensors")).keys() == \
        get_peft_model_state_dict(model).keys()
    assert any(".experts.base_layer.lora_B" in n for n, _ in model.named_parameters()) == expert_lora
    if fam.shared_experts:  # PEFT kept the shared experts' LoRA where the engine trained it
        assert any(f".{fam.shared_experts}." in n and "lora_B" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        for rank, r in enumerate(ranks):
            torch.testing.assert_close(model(**batch(rank, step=99)).logits, r["logits"], rtol=1e-4, atol=1e-5)
            # the trained adapter moved the model: the same batch on the plain model gives other logits
            with model.disable_adapter():
                assert not torch.allclose(model(**batch(rank, step=99)).logits, r["logits"], atol=1e-3)


def test_the_adapter_at_ep2_holds_every_rank_s_expert_factors_bit_for_bit(ep_runs):
    """Every EP rank's expert LoRA reaches the chief by gather, into receive buffers that NCCL writes as dense
    bytes: B's slab is a permuted view, whose empty_like kept its strides (gloo copied into them correctly, NCCL
    would not; the checked collectives refuse such a buffer on gloo too)."""
    from bench.support.export_check import export_mismatches

    out, _ = ep_runs("export-ep2")
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert export_mismatches(str(out), 2) == []
