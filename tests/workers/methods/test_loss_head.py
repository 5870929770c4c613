"""The training loss through the output layer itself (methods.loss_head + kernels.loss) equals the plain loss over
the model's logits, and so do the LoRA gradients, with and without activation checkpointing, on families with
different output paths (plain, multimodal text path, hybrid Mamba)."""

import copy

import pytest
import torch

from moetune.workers.families import REGISTRY
from moetune.workers.methods.batch import IGNORE, Batch
from moetune.workers.methods.sft import SupervisedMethod, token_loss_sum
from moetune.workers.model import trainable_model
from bench.support.tiny_models import batch, plain_model
from bench.support.harness import spec


def _batch() -> Batch:
    b = batch(rank=0, step=0, micro=2, seq=16)
    labels = b.pop("labels")
    labels[0, :5] = IGNORE  # a prompt that carries no loss
    return Batch(b, labels, labels.numel())


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family,checkpointing", [("kimi_linear", False), ("kimi_linear", True),
                                                   ("qwen3_5_moe", False), ("nemotron_h", False)])
def test_loss_head_equals_the_plain_loss_and_gradients(family, checkpointing):
    torch.manual_seed(1)
    job = spec(ep=1, zero=2, checkpointing=checkpointing)
    model = trainable_model(plain_model(REGISTRY[family]), job.lora, job.training, None)
    assert not model.config.get_text_config().use_cache  # training builds no KV cache
    plain = copy.deepcopy(model)
    b = _batch()
    want = token_loss_sum(plain(**b.inputs).logits, b.labels)
    want.backward()

    method = SupervisedMethod(tokenizer=None, seq_len=16)
    method.prepare(model)
    assert method.head is not None
    with torch.no_grad():  # unarmed, the head is the plain output layer
        torch.testing.assert_close(model(**b.inputs).logits, plain(**b.inputs).logits)
    got = method.loss_sum(model, b)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    expected = _grads(plain)
    assert expected.keys() == _grads(model).keys()
    for name, grad in _grads(model).items():
        scale = float(expected[name].abs().max())  # fp32 summation order differs: 1e-5 of the largest entry
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-5 * scale, msg=name)
