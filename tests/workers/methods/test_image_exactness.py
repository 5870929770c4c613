"""Image + text micro-batches: moetune's model (kernel swaps, LoRA, the loss through the output layer) against stock
transformers *ForConditionalGeneration + PEFT, in one process for every family that takes images (qwen3_5_moe,
glm5_next: its KDA and sparse-attention swaps) and with EP=2 on qwen3_5_moe."""

import pytest
import torch

from moetune.workers.families import REGISTRY, apply_kernel_swaps
from moetune.workers.lora.peft_lora import apply_lora
from moetune.workers.methods.sft import token_loss_sum
from moetune.workers.model import trainable_model
from moetune.workers.parallel import job_placement
from moetune.workers.tiny import write_tiny_multimodal_checkpoint
from tests.support.image_batches import image_batch, image_method, image_model, run_image_ep
from tests.workers.parallel.harness import launch, spec


@pytest.fixture(scope="module", params=["qwen3_5_moe", "glm5_next"])
def tiny_vl(request, tmp_path_factory):
    return write_tiny_multimodal_checkpoint(str(tmp_path_factory.mktemp(request.param)),
                                            REGISTRY[request.param].tiny_config)


@pytest.fixture(scope="module")
def method(tiny_vl):
    return image_method(tiny_vl)


def _reference(tiny_vl, method, job, ranks) -> tuple[float, dict]:
    """Stock transformers + PEFT, same LoRA draw: the rank-mean of the loss sums and its LoRA gradients."""
    model = image_model(tiny_vl)
    torch.manual_seed(1)
    peft_model = apply_lora(model, job.lora)
    loss = sum(token_loss_sum(peft_model(**b.inputs).logits, b.labels)
               for b in (image_batch(method, r) for r in ranks)) / len(ranks)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}


def _assert_grads(got: dict, want: dict):
    assert got.keys() == want.keys() and any("vision" not in n for n in want)
    for name, expected in want.items():
        if expected is None:  # glm5_next's indexer LoRA: its top-k selection passes no gradient, on either side
            assert got[name] is None and ".indexer." in name, name
            continue
        assert expected.abs().max() > 0 or "lora_A" in name, name  # B starts at 0: only B has a first gradient
        torch.testing.assert_close(got[name], expected, rtol=1e-4, atol=1e-6, msg=name)


def _moetune_model(tiny_vl, job):
    """As a job builds it: kernel swaps (none on qwen3_5_moe's CPU path; KDA and sparse attention on glm5_next),
    LoRA (in one process the experts stay transformers' own; the EP=2 test runs them split, on kernels.moe's
    grouped GEMMs)."""
    model = image_model(tiny_vl)
    swapped = apply_kernel_swaps(model)
    assert model.config.model_type == "qwen3_5_moe" or all(swapped.values()), swapped
    torch.manual_seed(1)
    return trainable_model(model, job, job_placement(model.config.to_dict(), job))


def test_moetune_model_gives_stock_logits_on_images(tiny_vl, method):
    model = _moetune_model(tiny_vl, spec(ep=1, zero=2, world=1)).eval()
    stock = image_model(tiny_vl).eval()
    batch = image_batch(method, rank=0)
    assert batch.inputs["pixel_values"].shape[0] > 0 and "attention_mask" in batch.inputs  # mixed, padded
    with torch.no_grad():  # LoRA B starts at 0: the base model's function
        torch.testing.assert_close(model(**batch.inputs).logits, stock(**batch.inputs).logits, rtol=1e-5,
                                   atol=1e-5)


def test_first_loss_and_lora_gradients_match_transformers_peft(tiny_vl, method):
    job = spec(ep=1, zero=2, world=1)
    model = _moetune_model(tiny_vl, job)
    method.prepare(model)
    loss = method.loss_sum(model, image_batch(method, rank=0))
    loss.backward()
    want_loss, want_grads = _reference(tiny_vl, method, job, ranks=[0])
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    _assert_grads({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, want_grads)


@pytest.mark.parametrize("tiny_vl", ["qwen3_5_moe"], indirect=True)
def test_ep2_first_loss_and_lora_gradients_match_transformers_peft(tiny_vl, method, tmp_path):
    """Two processes, the routed experts split between them; each rank its own image batch."""
    job = spec(ep=2, zero=2)
    assert job.lora.train_experts is False and job.training.custom_kernels  # experts split, grouped GEMMs
    launch(run_image_ep, 2, tiny_vl, job.model_dump_json(), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want_loss, want_grads = _reference(tiny_vl, method, job, ranks=[0, 1])
    assert sum(r["loss"] for r in ranks) / 2 == pytest.approx(want_loss, rel=1e-6)
    for r in ranks:
        _assert_grads(r["grads"], want_grads)
