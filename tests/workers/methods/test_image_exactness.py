"""Image + text micro-batches: moetune's model (kernel swaps, LoRA, the loss through the output layer) against stock
transformers *ForConditionalGeneration + PEFT, in one process for every family that takes images (qwen3_5_moe: its
Gated DeltaNet on kernels.kda; glm5_next: its KDA and sparse-attention swaps); EP=2 on qwen3_5_moe is one of tests/workers/experts's cases."""

import pytest
import torch

from moetune.workers.families import REGISTRY, apply_kernel_swaps
from moetune.workers.model import trainable_model
from moetune.workers.experts.placement import job_placement
from moetune.workers.tiny import write_tiny_multimodal_checkpoint
from bench.support.image_batches import (assert_grads, image_batch, image_method, image_model, reference,
                                         with_padding_mask)
from bench.support.harness import spec


@pytest.fixture(scope="module", params=["qwen3_5_moe", "glm5_next"])
def tiny_vl(request, tmp_path_factory):
    return write_tiny_multimodal_checkpoint(str(tmp_path_factory.mktemp(request.param)),
                                            REGISTRY[request.param].tiny_config)


@pytest.fixture(scope="module")
def method(tiny_vl):
    return image_method(tiny_vl)


def _moetune_model(tiny_vl, job):
    """As a job builds it: kernel swaps (Gated DeltaNet on qwen3_5_moe; KDA and sparse attention on glm5_next),
    LoRA (in one process the experts stay transformers' own; the EP=2 test runs them split, on kernels.moe's
    grouped GEMMs)."""
    model = image_model(tiny_vl)
    swapped = apply_kernel_swaps(model)
    assert all(swapped.values()), swapped
    torch.manual_seed(1)
    placement = job_placement(model.config.to_dict(), job.parallelism, job.lora)
    return trainable_model(model, job.lora, job.training, placement)


def test_moetune_model_gives_stock_logits_on_images(tiny_vl, method):
    model = _moetune_model(tiny_vl, spec(ep=1, zero=2, world=1)).eval()
    stock = image_model(tiny_vl).eval()
    batch = image_batch(method, rank=0)
    # mixed and padded, without a padding mask (the stock model gets the processor's)
    assert batch.inputs["pixel_values"].shape[0] > 0 and "attention_mask" not in batch.inputs
    masked = with_padding_mask(batch.inputs, method.tokenizer.pad_token_id)
    assert not masked["attention_mask"].all()
    real = masked["attention_mask"].bool()
    with torch.no_grad():  # LoRA B starts at 0: the base model's function, on every real token
        torch.testing.assert_close(model(**batch.inputs).logits[real], stock(**masked).logits[real], rtol=1e-5,
                                   atol=1e-5)


def test_first_loss_and_lora_gradients_match_transformers_peft(tiny_vl, method):
    job = spec(ep=1, zero=2, world=1)
    model = _moetune_model(tiny_vl, job)
    method.prepare(model)
    loss = method.loss_sum(model, image_batch(method, rank=0))
    loss.backward()
    want_loss, want_grads = reference(tiny_vl, method, job, ranks=[0])
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    assert_grads({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, want_grads)
