"""Packed micro-batches (kimi_linear, deepseek_v3, kimi_k25 and kimi_k3 with their kernel swaps): sequences end to end in one
row train exactly as the same sequences right-padded — loss and every LoRA gradient — and the KDA short conv reads
nothing across a boundary.
"""

import copy

import pytest
import torch

from moetune.workers.families import REGISTRY, apply_kernel_swaps
from moetune.workers.families.kda import _short_conv
from moetune.workers.methods.batch import IGNORE
from moetune.workers.methods.sft import Example, SupervisedMethod, collate
from moetune.workers.model import trainable_model
from bench.support.tiny_models import plain_model
from bench.support.harness import spec


def _examples() -> list[Example]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n, prompt in ((9, 3), (16, 0), (5, 2)):
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        out.append(Example(ids, [IGNORE] * prompt + ids[prompt:]))
    return out


@pytest.mark.parametrize("name", ["kimi_linear", "deepseek_v3", "kimi_k25", "kimi_k3"])
def test_packed_micro_batch_trains_as_the_padded_one(name):
    torch.manual_seed(1)
    model = plain_model(REGISTRY[name])
    assert apply_kernel_swaps(model)["apply_segment_attention"] >= 1
    job = spec(ep=1, zero=2)
    model = trainable_model(model, job.lora, job.training, None)
    padded_model = copy.deepcopy(model)
    method = SupervisedMethod(tokenizer=None, seq_len=64)
    method.prepare(model)
    assert method.pack
    packed = method.collate(_examples())
    assert packed.inputs["input_ids"].shape == (1, 30) and "attention_mask" not in packed.inputs
    padded = collate(_examples(), pad_id=0)
    loss = method.loss_sum(model, packed)
    loss.backward()
    reference = SupervisedMethod(tokenizer=None, seq_len=64)
    reference.prepare(padded_model)
    want = reference.loss_sum(padded_model, padded)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    expected = {n: p.grad for n, p in padded_model.named_parameters() if p.requires_grad}
    for name, param in model.named_parameters():
        if param.requires_grad:
            scale = float(expected[name].abs().max())
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_short_conv_keeps_sequences_apart():
    from transformers.models.kimi_linear.modeling_kimi_linear import causal_conv1d_fn

    stock = causal_conv1d_fn._moetune_stock if hasattr(causal_conv1d_fn, "_moetune_stock") else causal_conv1d_fn
    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(1, 6, 20, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    offsets = torch.tensor([0, 7, 8, 20], dtype=torch.int32)  # a one-token sequence in the middle
    packed = _short_conv(stock, x, weight, bias, "silu", cu_seq_lens_q=offsets)
    apart = torch.cat([stock(x[..., a:b], weight, bias, "silu") for a, b in ((0, 7), (7, 8), (8, 20))], dim=-1)
    torch.testing.assert_close(packed, apart)
    assert not torch.allclose(stock(x, weight, bias, "silu"), apart)  # the stock conv mixes them
