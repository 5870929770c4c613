"""deepseek_v32's DSA swap: with the chunked indexer, the row-block mask and the sparse-attention kernel, a tiny
DeepSeek-V3.2 (top-4 of up to 40 keys: most queries attend to a strict subset, one row left-padded) gives
transformers' own logits and LoRA gradients, and a 2048-token forward builds no tensor the size of a T×T mask."""

from __future__ import annotations

import copy

import pytest
import torch

from moetune.workers.families import REGISTRY, apply_kernel_swaps, auto_model_class
from moetune.workers.families.deepseek_v32 import dsa
from tests.support.allocations import Allocations


def _model(**overrides):
    from peft import LoraConfig, get_peft_model

    config = REGISTRY["deepseek_v32"].tiny_config(**overrides)
    torch.manual_seed(0)
    model = auto_model_class(config).from_config(config, dtype=torch.float32).eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_b_proj", "kv_b_proj", "o_proj", "wq_b"],
                      init_lora_weights=False)  # random B too: every LoRA gradient is non-trivial
    return get_peft_model(model, lora)


def _run(model, input_ids, attention_mask):
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    keep = attention_mask.bool()
    out.logits[keep].logsumexp(-1).mean().backward()
    return out.logits[keep], {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_swapped_model_matches_transformers():
    stock = _model()
    swapped = copy.deepcopy(stock)
    assert apply_kernel_swaps(swapped.base_model.model) == {"apply_dsa_kernels": 3}
    assert apply_kernel_swaps(swapped.base_model.model) == {"apply_dsa_kernels": 0}
    assert stock.base_model.model.config._attn_implementation != dsa.ATTN_IMPLEMENTATION
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    want, want_grads = _run(stock, ids, mask)
    got, grads = _run(swapped, ids, mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert grads.keys() == want_grads.keys() and any(".indexer.wq_b" in n for n in grads)
    for name, ref in want_grads.items():
        if ".indexer." in name:  # selection carries no gradient, in transformers as here
            assert grads[name] is None and ref is None, name
            continue
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.parametrize("swap", [True, False])
def test_no_txt_tensor_at_2048_tokens(monkeypatch, swap):
    """The recorder sees transformers' own T×T mask (the sabotage: no swap), and nothing that large with it."""
    seq_len = 2048
    model = _model(num_hidden_layers=2, index_topk=64)
    if swap:
        apply_kernel_swaps(model.base_model.model)
        monkeypatch.setattr(dsa, "ROW_ELEMENTS", 1 << 16)  # blocks of 16 query rows
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), Allocations() as recorder:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert (recorder.largest_bytes < seq_len * seq_len) == swap, recorder.largest_bytes
