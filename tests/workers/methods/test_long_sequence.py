"""A 16K-token LoRA step of the seed family (a KDA layer and an MLA full-attention layer, moetune's kernels; two
packed sequences) with the training loss allocates no tensor anywhere near T × T elements: no attention mask, no
dense attention scores, no [T, vocab] logits beyond one chunk. The recorder sees every op, forward and backward."""

import torch

from moetune.workers.families import REGISTRY, apply_kernel_swaps
from moetune.workers.methods.sft import Example, SupervisedMethod
from moetune.workers.model import trainable_model
from tests.support.allocations import Allocations
from tests.support.families import plain_model
from tests.workers.parallel.harness import spec

T = 16_384


def test_a_16k_step_allocates_nothing_quadratic():
    fam = REGISTRY["kimi_linear"]
    config = fam.tiny_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                             mlp_layer_types=["dense", "sparse"], max_position_embeddings=T,
                             num_attention_heads=1, num_key_value_heads=1)  # one head: the step's time is attention
    model = plain_model(fam, config=config)
    assert apply_kernel_swaps(model)
    model = trainable_model(model, spec(ep=1, zero=2), None)
    method = SupervisedMethod(tokenizer=None, seq_len=T)
    method.prepare(model)
    assert method.pack  # two 8K sequences end to end in one 16K row: no mask keeps them apart, the layers do
    ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = method.collate([Example(ids[:T // 2], ids[:T // 2]), Example(ids[T // 2:], ids[T // 2:])])
    assert batch.inputs["input_ids"].shape == (1, T)
    with Allocations() as seen:
        method.loss_sum(model, batch).backward()
    # the largest tensors are the KDA kernel's per-chunk tiles, linear in T (1/32 of T² at 16K)
    assert 0 < seen.largest <= T * T // 32, seen.largest
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
