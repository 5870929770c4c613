"""Per-rank checkpoints with exact resume, and the exported adapter on the plain transformers model."""

import os

import pytest
import torch

from tests.ep.harness import SAVE_AFTER, STEPS, batch, launch, plain_model, run_and_resume, spec


@pytest.mark.parametrize("zero", [2, 3])
def test_resume_is_exact_and_adapter_loads_into_peft(tmp_path, zero):
    from peft import PeftModel

    from workers.families import family

    job = spec(ep=2, zero=zero, steps=STEPS, train_experts=True, lr=3e-2)
    launch(run_and_resume, 2, "qwen3_moe", job.model_dump_json(), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        assert r["resumed"] == r["losses"][SAVE_AFTER:]  # bit-exact
    assert sorted(os.listdir(tmp_path / "ckpt" / "expert_lora")) == ["ep-0-of-2.safetensors", "ep-1-of-2.safetensors"]

    model = PeftModel.from_pretrained(plain_model(family("qwen3_moe")), str(tmp_path / "adapter")).eval()
    assert any(".experts.base_layer.lora_B" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        for rank, r in enumerate(ranks):
            torch.testing.assert_close(model(**batch(rank, step=99)).logits, r["logits"], rtol=1e-4, atol=1e-5)
            # the trained adapter moved the model: the same batch on the plain model gives other logits
            with model.disable_adapter():
                assert not torch.allclose(model(**batch(rank, step=99)).logits, r["logits"], atol=1e-3)
