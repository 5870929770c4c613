"""Image + text micro-batches with EP=2 (the routed experts split between the two ranks, on kernels.moe's grouped
GEMMs, each rank its own image batch): first loss and every LoRA gradient equal single-process stock transformers +
PEFT on both ranks' batches, for qwen3_5_moe and for glm5_next (KDA and sparse attention over the MLA latent
swapped in too)."""

import pytest
import torch

from bench.support.image_batches import assert_grads, image_method, reference, round_off
from tests.workers.experts.cases import IMAGE_CASES, IMAGELESS_RANK_CASES

# Families whose fp32 round-off is above the default atol (1e-6): Kimi K3's tiny model (initializer_range 0.1: LoRA
# B gradients up to ~7). Its stock fp32 reference is up to 2.1e-5 of max|grad| from the same model in float64, and
# moetune's EP=2 gradients up to 2.3e-5: the two round-offs add up to 2.7e-5 between them on one machine, and
# differ from machine to machine (a fixed 2e-5 between them passed on one and failed on another). So moetune's
# gradients are checked against float64, within twice the stock reference's own round-off there.
CHECKED_IN_FLOAT64 = {"kimi_k3"}


@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_ep2_first_loss_and_lora_gradients_match_transformers_peft(ep_runs, case):
    family, job = IMAGE_CASES[case]
    assert job.lora.train_experts is False and job.training.custom_kernels  # experts split, grouped GEMMs
    out, ranks = ep_runs(case)
    model_dir = str(out.parent / f"{case}-model")
    method = image_method(model_dir)
    want_loss, want_grads = reference(model_dir, method, job, ranks=[0, 1])
    assert sum(r["loss"] for r in ranks) / 2 == pytest.approx(want_loss, rel=1e-6)
    atol_per_max = 0.0
    if family in CHECKED_IN_FLOAT64:
        exact_loss, exact = reference(model_dir, method, job, ranks=[0, 1], dtype=torch.float64)
        assert want_loss == pytest.approx(exact_loss, rel=1e-6)
        atol_per_max, want_grads = 2 * round_off(want_grads, exact), exact
    for r in ranks:
        assert_grads(r["grads"], want_grads, atol_per_max)


@pytest.mark.parametrize("case", list(IMAGELESS_RANK_CASES))
def test_zero3_with_a_rank_whose_micro_batch_has_no_image(ep_runs, case):
    """Under ZeRO-3 every vision module gathers its weights by a collective: rank 1 (text only) runs the tower on a
    blank image so that both ranks run the same gathers (without it gloo fails with "Received data size doesn't
    match expected size"; NCCL hangs), and the loss and gradients are still exactly the two batches'."""
    _, job = IMAGELESS_RANK_CASES[case]
    out, ranks = ep_runs(case)
    model_dir = str(out.parent / f"{case}-model")
    method = image_method(model_dir)
    want_loss, want_grads = reference(model_dir, method, job, ranks=[0, 1], text_only_rank=1)
    assert sum(r["loss"] for r in ranks) / 2 == pytest.approx(want_loss, rel=1e-6)
    for r in ranks:
        assert_grads(r["grads"], want_grads)
