"""An 8K-token LoRA step with the training loss allocates no tensor anywhere near T × T elements: no attention mask, no
dense attention scores, no [T, vocab] logits beyond one chunk. The recorder sees every op, forward and backward.

Every family whose full attention is dense MLA runs at the released head ratio (qk_nope 128 : rope 64 : v 128, here
16 : 8 : 16: the key wider than the value, which PyTorch's CPU SDPA would take to its math path), packed (two
sequences in one row) on its kernel swaps; the seed family with a KDA layer too. A padding family's micro-batch of
two rows builds no [B, 1, T, T] mask."""

import pytest
import torch

from moetune.workers.families import REGISTRY, apply_kernel_swaps
from moetune.workers.methods.sft import Example, SupervisedMethod, collate
from moetune.workers.model import trainable_model
from tests.support.allocations import Allocations
from bench.support.tiny_models import plain_model
from bench.support.harness import spec

T = 8192
ONE_HEAD = {"num_attention_heads": 1, "num_key_value_heads": 1, "max_position_embeddings": T}  # time is attention
MLA = {
    "kimi_linear": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                    "mlp_layer_types": ["dense", "sparse"], "linear_num_heads": 1},
    "deepseek_v3": {"num_hidden_layers": 1},
    "kimi_k25": {"num_hidden_layers": 1},
}


def _step_allocations(model, pack: bool, lengths: tuple[int, ...]) -> int:
    """The largest tensor a training step over sequences of `lengths` allocates."""
    job = spec(ep=1, zero=2)
    model = trainable_model(model, job.lora, job.training, None)
    method = SupervisedMethod(tokenizer=None, seq_len=T)
    method.prepare(model)
    assert method.pack == pack
    ids = torch.randint(0, 256, (sum(lengths),), generator=torch.Generator().manual_seed(0)).tolist()
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    examples = [Example(ids[a:a + n], ids[a:a + n]) for a, n in zip(starts, lengths)]
    batch = method.collate(examples) if pack else collate(examples, pad_id=0)
    assert "attention_mask" not in batch.inputs
    with Allocations() as seen:
        method.loss_sum(model, batch).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return seen.largest


@pytest.mark.parametrize("name", sorted(MLA))
def test_an_8k_mla_step_allocates_nothing_quadratic(name):
    family = REGISTRY[name]
    config = family.tiny_config(**ONE_HEAD, **MLA[name])
    text = config.get_text_config()
    assert text.qk_nope_head_dim + text.qk_rope_head_dim > text.v_head_dim  # the released shape
    model = plain_model(family, config=config)
    assert apply_kernel_swaps(model)
    largest = _step_allocations(model, pack=True, lengths=(T // 2, T // 2))  # one row: no mask keeps them apart
    # the largest tensors are linear in T (the KDA kernel's per-chunk tiles, the loss's logits chunk)
    assert 0 < largest < T * T // 32, largest


def test_a_padded_micro_batch_of_two_rows_allocates_nothing_quadratic():
    family = REGISTRY["qwen3_moe"]
    # top-1: the experts' [B·T·k, 2·moe_intermediate] tile stays below the bound (B = 2)
    config = family.tiny_config(**ONE_HEAD, num_hidden_layers=1, num_experts_per_tok=1)
    largest = _step_allocations(plain_model(family, config=config), pack=False, lengths=(T, T // 2))  # [2, T]
    assert 0 < largest < T * T // 32, largest
