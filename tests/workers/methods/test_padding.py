"""A right-padded micro-batch carries no attention mask (workers/methods/sft.py `collate`), so transformers builds no
[B, 1, T, T] one: in every family (on its kernel swaps, where it has them), the loss and every LoRA gradient equal
those of the same batch under transformers' padding mask."""

import pytest
import torch

from moetune.workers.families import REGISTRY
from moetune.workers.methods.batch import IGNORE, Batch
from moetune.workers.methods.sft import Example, SupervisedMethod, collate
from moetune.workers.model import trainable_model
from bench.support.tiny_models import plain_model
from bench.support.harness import spec

LENGTHS = (9, 16, 5)


def _examples() -> list[Example]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n, prompt in zip(LENGTHS, (3, 0, 2)):
        ids = torch.randint(3, 256, (n,), generator=g).tolist()
        out.append(Example(ids, [IGNORE] * prompt + ids[prompt:]))
    return out


def _loss_and_grads(model, batch: Batch):
    method = SupervisedMethod(tokenizer=None, seq_len=max(LENGTHS))
    method.prepare(model)
    model.zero_grad()
    loss = method.loss_sum(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_right_padded_micro_batch_trains_as_the_masked_one(name):
    family = REGISTRY[name]
    model = plain_model(family)
    family.apply_kernel_swaps(model)
    job = spec(ep=1, zero=2)
    model = trainable_model(model, job.lora, job.training, None)
    batch = collate(_examples(), pad_id=0)
    assert "attention_mask" not in batch.inputs and batch.inputs["input_ids"].shape == (3, max(LENGTHS))
    mask = (batch.inputs["input_ids"] != 0).long()  # the real tokens (ids from 3 up), wherever collate put them
    masked = Batch({**batch.inputs, "attention_mask": mask}, batch.labels, batch.tokens)
    loss, grads = _loss_and_grads(model, batch)
    want, expected = _loss_and_grads(model, masked)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected.keys() and grads
    for param, grad in grads.items():
        scale = float(expected[param].abs().max())
        torch.testing.assert_close(grad, expected[param], rtol=1e-5, atol=1e-5 * scale + 1e-12, msg=param)
