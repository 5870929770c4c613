"""deepseek_v32's DSA swap: with the chunked indexer, the row-block mask and the sparse-attention kernel, a tiny
DeepSeek-V3.2 (top-4 of up to 40 keys: most queries attend to a strict subset, one row left-padded) gives
transformers' own logits and LoRA gradients, and a 2048-token forward builds no tensor the size of a T×T mask."""

from __future__ import annotations

import copy

import pytest
import torch

from moetune.kernels.sparse_attention import indexer as sparse_indexer
from moetune.workers.families import REGISTRY, apply_kernel_swaps, auto_model_class, mla
from moetune.workers.families.deepseek_v32 import dsa
from tests.support.allocations import Allocations


def _model(dropout=0.0, **overrides):
    from peft import LoraConfig, get_peft_model

    config = REGISTRY["deepseek_v32"].tiny_config(**overrides)
    torch.manual_seed(0)
    model = auto_model_class(config).from_config(config, dtype=torch.float32).eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_b_proj", "kv_b_proj", "o_proj", "wq_b"],
                      lora_dropout=dropout, init_lora_weights=False)  # random B too: every LoRA gradient non-trivial
    return get_peft_model(model, lora)


def _run(model, input_ids, attention_mask):
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    keep = attention_mask.bool()
    out.logits[keep].logsumexp(-1).mean().backward()
    return out.logits[keep], {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _kv_heads_seen(monkeypatch) -> list[int]:
    """The kv head count of every sparse-attention call (1: over the shared latent)."""
    seen, original = [], mla.sparse_attention
    monkeypatch.setattr(mla, "sparse_attention", lambda q, k, *args, **kwargs: seen.append(k.shape[2])
                        or original(q, k, *args, **kwargs))
    return seen


def test_swapped_model_matches_transformers(monkeypatch):
    kv_heads = _kv_heads_seen(monkeypatch)
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
    assert kv_heads == [1, 1, 1]  # each layer attended over its latent (absorbed), not over per-head keys
    assert grads.keys() == want_grads.keys() and any(".indexer.wq_b" in n for n in grads)
    for name, ref in want_grads.items():
        if ".indexer." in name:  # selection carries no gradient, in transformers as here
            assert grads[name] is None and ref is None, name
            continue
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-3, atol=1e-6, msg=name)


def test_lora_dropout_on_kv_b_proj_rides_in_the_latent_while_training(monkeypatch):
    """A per-token dropout mask inside kv_b_proj has no single matrix to absorb: each token's A·dropout(c) joins
    the latent instead. Training with it attends over the latent and gives transformers' loss and gradients with
    the same dropout draws."""
    kv_heads = _kv_heads_seen(monkeypatch)
    stock = _model(dropout=0.3, num_hidden_layers=2)
    swapped = copy.deepcopy(stock)
    apply_kernel_swaps(swapped.base_model.model)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    runs = []
    for model in (stock.train(), swapped.train()):
        torch.manual_seed(4)  # the same dropout masks in both
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss, {n: p.grad for n, p in model.named_parameters() if "kv_b_proj" in n and p.requires_grad}))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-6)
    assert len(runs[0][1]) == 4 and all(g.abs().max() > 0 for g in runs[0][1].values())
    for name, want in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], want, rtol=1e-4, atol=1e-6, msg=name)
    assert kv_heads == [1, 1]


def test_per_row_kv_b_weights_keep_the_expanded_form(monkeypatch):
    """The serving engine's mixed-adapter batch: kv_b_proj's weights differ by row, so the layer attends over
    per-head keys, and each row equals that row run alone (one adapter: absorbed)."""
    from moetune.workers.lora.row_slots import RowLoraLinear, RowSelection

    config = REGISTRY["deepseek_v32"].tiny_config(num_hidden_layers=2)
    torch.manual_seed(0)
    model = auto_model_class(config).from_config(config, dtype=torch.float32).eval()
    apply_kernel_swaps(model)
    selection, gen = RowSelection(), torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        proj = layer.self_attn.kv_b_proj
        rows = RowLoraLinear(proj, selection, 2, proj.in_features, proj.out_features, torch.float32, "cpu")
        rows.factors.put(1, {"a": torch.randn(4, proj.in_features, generator=gen),
                             "b": torch.randn(proj.out_features, 4, generator=gen)}, 0.5)
        layer.self_attn.kv_b_proj = rows
    kv_heads = _kv_heads_seen(monkeypatch)
    ids = torch.randint(0, 256, (2, 20), generator=gen)
    with torch.no_grad():
        selection.set([0, 1], "cpu")  # row 0 the base, row 1 the adapter
        mixed = model(input_ids=ids).logits
        assert kv_heads == [4, 4]
        alone = []
        for row, slot in enumerate((0, 1)):
            selection.set([slot], "cpu")
            alone.append(model(input_ids=ids[row:row + 1]).logits[0])
        selection.set([0], "cpu")
        row1_base = model(input_ids=ids[1:2]).logits[0]
    assert kv_heads == [4, 4] + [1, 1] * 3
    torch.testing.assert_close(mixed, torch.stack(alone), rtol=1e-4, atol=1e-5)
    assert (row1_base - alone[1]).abs().max() > 1e-2  # the adapter changes row 1's answer


@pytest.mark.parametrize("swap", [True, False])
def test_no_txt_tensor_at_2048_tokens(monkeypatch, swap):
    """The recorder sees transformers' own T×T mask (the sabotage: no swap), and nothing that large with it."""
    seq_len = 2048
    model = _model(num_hidden_layers=2, index_topk=64)
    if swap:
        apply_kernel_swaps(model.base_model.model)
        monkeypatch.setattr(sparse_indexer, "CPU_BUDGET_BYTES", 1 << 20)  # blocks of ~20 query rows
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), Allocations() as recorder:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert (recorder.largest_bytes < seq_len * seq_len) == swap, recorder.largest_bytes
