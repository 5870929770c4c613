"""End to end: a tiny random glm5_next (text path, two indexed-attention layers, the second reusing the first's
top-k) with the sparse-attention kernel swapped in gives the same logits and LoRA gradients as transformers' own
dense-mask attention."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.kernels.triton_child import on_triton, test_interpreter_run  # noqa: F401 (collected here)
from workers.kernel_swaps import apply_kernel_swaps
from workers.sparse_attention_swap import apply_sparse_attention_kernels

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
