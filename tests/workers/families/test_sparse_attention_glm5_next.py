"""End to end: a tiny random glm5_next (text path, two indexed-attention layers, the second reusing the first's
top-k) with the sparse-attention kernel swapped in gives the same logits and LoRA gradients as transformers' own
dense-mask attention; the swap's chunked indexer selects what transformers' indexer selects without a T×T tensor."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.triton_child import on_triton, test_interpreter_run  # noqa: F401 (collected here)
from moetune.kernels.sparse_attention import indexer as sparse_indexer
from moetune.workers.families import apply_kernel_swaps
from moetune.workers.families.glm5_next import indexer as glm5_next_indexer
from moetune.workers.families.glm5_next.sparse_attention import apply_sparse_attention_kernels
from tests.support.allocations import Allocations

TEXT = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 0, "v_head_dim": 16,
    # top-8 of 2-token pools at 40 tokens: most queries attend to a strict subset of their prefix
    "index_topk": 8, "index_head_dim": 16, "index_n_heads": 2, "index_kpool": 2,
    "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    "indexer_types": ["full", "full", "shared", "full"], "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "linear_num_heads": 2, "linear_head_dim": 16, "hc_mult": 2, "pad_token_id": 0, "initializer_range": 0.2,
}


@pytest.fixture(scope="module")
def lora_model():
    from peft import LoraConfig, get_peft_model
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    config = Glm5NextConfig(text_config=TEXT, vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                                                             "num_heads": 2, "out_hidden_size": 64})
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(config).eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_b_proj", "kv_b_proj", "o_proj"],
                      init_lora_weights=False)  # random B too, so LoRA gradients are all non-trivial
    return get_peft_model(model, lora)


def _logits_and_lora_grads(model, input_ids):
    out = model(input_ids=input_ids)
    out.logits.logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.logits, grads, out.logits.grad_fn


def _graph_names(node, seen=None):
    seen = set() if seen is None else seen
    if node is None or node in seen:
        return set()
    seen.add(node)
    names = {type(node).__name__}
    for child, _ in node.next_functions:
        names |= _graph_names(child, seen)
    return names


@pytest.mark.parametrize("how", ["registry", pytest.param("triton", marks=on_triton)])
def test_swapped_model_matches_transformers(lora_model, how):
    """registry: every glm5_next swap as a job gets them (KDA and sparse attention, PyTorch paths on CPU);
    triton: the sparse-attention Triton kernels (interpreted on CPU) alone."""
    swapped = copy.deepcopy(lora_model)
    if how == "registry":
        assert apply_kernel_swaps(swapped.base_model.model) == {"apply_kda_kernels": 2,
                                                                 "apply_sparse_attention_kernels": 2}
    else:
        assert apply_sparse_attention_kernels(swapped, backend="triton") == 2
        assert apply_sparse_attention_kernels(swapped) == 0  # already swapped
    assert lora_model.base_model.model.config.text_config._attn_implementation != "moetune_sparse"
    input_ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads, _ = _logits_and_lora_grads(copy.deepcopy(lora_model), input_ids)
    logits, grads, grad_fn = _logits_and_lora_grads(swapped, input_ids)
    assert "SparseAttentionFnBackward" in _graph_names(grad_fn)  # the kernel really ran
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    attention_grads = [n for n in ref_grads if "self_attn" in n]
    assert len(attention_grads) == 3 * 2 * 2 + 2 * 2  # q_b, kv_b, o_proj A/B in two DSA layers; o_proj in two KDA
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-3, atol=1e-6, msg=name)


def test_a_model_without_indexed_attention_is_left_alone():
    assert apply_sparse_attention_kernels(torch.nn.Linear(2, 2)) == 0


def _indexers(**overrides):
    """transformers' indexer with random weights (pool gate and position terms included) and its chunked twin."""
    from transformers import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    config = Glm5NextConfig(text_config={**TEXT, **overrides}).text_config
    torch.manual_seed(3)
    stock = Glm5NextTextIndexer(config, layer_idx=1)
    for p in stock.parameters():
        torch.nn.init.normal_(p, std=0.5)
    chunked = copy.deepcopy(stock)
    chunked.__class__ = glm5_next_indexer.ChunkedGlm5NextIndexer
    return stock, chunked


def _indexer_inputs(config, seq_len, batch=2, pad=0):
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(batch, seq_len, config.hidden_size, generator=gen)
    q_resid = torch.randn(batch, seq_len, config.q_lora_rank, generator=gen)
    mask = torch.ones(batch, seq_len, dtype=torch.bool)
    mask[0, :pad] = False  # left padding in one row: pools start at its first real token
    return hidden, q_resid, mask


@pytest.mark.parametrize("kpool,tail", [(2, True), (4, True), (4, False), (1, False)])
def test_chunked_indexer_selects_what_transformers_selects(monkeypatch, kpool, tail):
    stock, chunked = _indexers(index_kpool=kpool, index_kpool_always_select_tail=tail, index_topk=8)
    inputs = _indexer_inputs(stock.config, seq_len=45, pad=6)
    monkeypatch.setattr(sparse_indexer, "CPU_BUDGET_BYTES", 8 * 2 * 2 * 45 * 7)  # 7 query rows per block: 7 blocks
    want, got = stock(*inputs, cache=None), chunked(*inputs, cache=None)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got.sort(-1).values == want.sort(-1).values).all()  # the same set per query (order is topk's own)
    assert (want >= 0).any(-1)[:, 10:].all() and (want < 0).any()  # non-trivial: selections and -1 slots


def test_chunked_indexer_never_builds_a_txt_tensor(monkeypatch):
    seq_len = 2048
    stock, chunked = _indexers(index_kpool=2)
    inputs = _indexer_inputs(stock.config, seq_len, batch=1)
    monkeypatch.setattr(sparse_indexer, "CPU_BUDGET_BYTES", 8 << 18)
    with Allocations() as stock_seen:
        want = stock(*inputs, cache=None)
    with Allocations() as chunked_seen:
        got = chunked(*inputs, cache=None)
    assert stock_seen.largest_bytes >= seq_len * seq_len  # the hook sees transformers' T×T boolean mask
    # each block's intermediates within the budget (8 bytes an element: the stock tail helper counts keys in int64)
    assert chunked_seen.largest_bytes <= 8 << 18 < seq_len * seq_len, chunked_seen.largest_bytes
    assert (got.sort(-1).values == want.sort(-1).values).all()


def test_swapped_model_decodes_with_a_kv_cache_like_transformers(lora_model):
    """Prefill of a left-padded batch, then token-by-token decoding: the chunked indexer's cache path (keys from
    the cache, query positions past the prompt) picks what transformers' picks, so the logits agree."""
    base = lora_model.base_model.model
    swapped = copy.deepcopy(base)
    apply_kernel_swaps(swapped)
    with_cache = []
    for indexer in (m for m in swapped.modules() if isinstance(m, glm5_next_indexer.ChunkedGlm5NextIndexer)):
        indexer.register_forward_pre_hook(lambda _, args, kwargs: with_cache.append(kwargs.get("cache") is not None),
                                          with_kwargs=True)
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0  # left padding in one row
    runs = []
    with torch.no_grad():
        for model in (base, swapped):
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            logits, step_mask = [out.logits[:, -1]], mask
            for _ in range(6):
                step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], dim=1)
                out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=step_mask,
                            cache=out.past_key_values, use_cache=True)
                logits.append(out.logits[:, -1])
            runs.append(torch.stack(logits))
    assert with_cache == [True] * 7  # prefill and 6 steps, all through the cache (the second layer shares top-k)
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=1e-4)
