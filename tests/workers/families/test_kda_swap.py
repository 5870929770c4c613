"""KDA kernels swapped into a tiny kimi_linear: same logits and LoRA gradients as the stock model, the kernel is
really the one running, and a model that was not swapped keeps the stock path in the same process."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.kda_cases import rmse_ratio
from moetune.workers.families import apply_kernel_swaps, kda
from moetune.workers.families.kimi_linear.tiny import tiny_config

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj", "o_proj"]


@pytest.fixture
def stock_model():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(264, 0, 1, 2), dtype=torch.float32)
    with torch.no_grad():  # a spread of decays, as in a trained model (init leaves A_log/dt_bias uninformative)
        for name, param in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                param.normal_(0.0, 1.0)
    # init_lora_weights=False: B is random too, so the gradients of A are not trivially zero
    return get_peft_model(model, LoraConfig(r=4, target_modules=LORA_TARGETS, init_lora_weights=False))


def logits_and_lora_grads(model, input_ids):
    model.zero_grad()
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if "lora_" in name}
    return out.logits.detach(), grads


def _count_calls(monkeypatch, name: str) -> list:
    """Counts calls into kernels.kda's `name` made through the swap (the real function still runs)."""
    calls, real = [], getattr(kda, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kda, name, counted)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch):
    return _count_calls(monkeypatch, "chunk_kda")


def test_swapped_model_matches_stock(stock_model, kernel_calls):
    input_ids = torch.randint(3, 264, (2, 75))  # 75 tokens: not a multiple of the 64-token chunk
    swapped = copy.deepcopy(stock_model)
    # the 3 KDA layers of tiny, and its MLA layer's packed-sequence attention (unpacked here: transformers' SDPA)
    assert apply_kernel_swaps(swapped) == {"apply_kda_kernels": 3, "apply_segment_attention": 1}
    assert apply_kernel_swaps(swapped) == {"apply_kda_kernels": 0, "apply_segment_attention": 0}  # idempotent

    ref_logits, ref_grads = logits_and_lora_grads(stock_model, input_ids)
    assert kernel_calls == []  # the stock model never reaches our kernel
    logits, grads = logits_and_lora_grads(swapped, input_ids)
    assert len(kernel_calls) == 3

    assert rmse_ratio(logits, ref_logits) <= 1e-4
    assert grads.keys() == ref_grads.keys() and any("f_a_proj" in name for name in grads)
    worst = max(rmse_ratio(grads[name], ref_grads[name]) for name in grads)
    assert worst <= 0.005, worst

    # The swap travels with a copy of the model (the hooks are part of the modules).
    with torch.no_grad():
        copy.deepcopy(swapped)(input_ids=input_ids[:, :10])
    assert len(kernel_calls) == 6


def test_family_without_swaps_is_untouched():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=2,
                            num_experts_per_tok=1)
    assert apply_kernel_swaps(Qwen3MoeForCausalLM(config)) == {}


def test_glm5_next_linear_attention_swapped(kernel_calls):
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    config = Glm5NextTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=8,
        q_lora_rank=8, v_head_dim=16, qk_nope_head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=16,
        index_kpool=4, layer_types=["linear_attention"] * 2, mlp_layer_types=["dense"] * 2, linear_head_dim=16,
        linear_num_heads=2, hc_mult=2, pad_token_id=0)
    torch.manual_seed(0)
    stock = Glm5NextTextModel(config)
    with torch.no_grad():
        for name, param in stock.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                param.normal_(0.0, 1.0)
    swapped = copy.deepcopy(stock)
    # the sparse-attention swap is registered for glm5_next too; this model has no indexed-attention layer
    assert apply_kernel_swaps(swapped) == {"apply_kda_kernels": 2, "apply_sparse_attention_kernels": 0}
    input_ids = torch.randint(1, 64, (2, 50))
    outputs = []
    for model in (stock, swapped):
        hidden = model(input_ids=input_ids, use_cache=False).last_hidden_state
        hidden.square().mean().backward()
        outputs.append((hidden.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (ref, ref_grads), (ours, grads) = outputs
    assert len(kernel_calls) == 2 and rmse_ratio(ours, ref) <= 1e-4
    assert any("f_a_proj" in name for name in grads)
    assert max(rmse_ratio(grads[name], ref_grads[name]) for name in ref_grads) <= 0.005


@pytest.fixture
def gated_delta_calls(monkeypatch):
    return _count_calls(monkeypatch, "chunk_gated_delta_rule")


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_gated_deltanet_swapped_matches_transformers(family, gated_delta_calls):
    """Gated DeltaNet (one decay per head, two value heads per query/key head in the tiny configs) on kernels.kda:
    the stock transformers model's logits and LoRA gradients (qwen3_5_moe: its text path, no image)."""
    from peft import LoraConfig, get_peft_model

    from moetune.workers.families import REGISTRY
    from bench.support.tiny_models import plain_model

    stock = plain_model(REGISTRY[family])
    with torch.no_grad():  # a spread of decays, as in a trained model
        for name, param in stock.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                param.normal_(0.0, 1.0)
    targets = ["in_proj_qkvz", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "in_proj_ba", "out_proj"]
    stock = get_peft_model(stock, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
    swapped = copy.deepcopy(stock)
    swaps = apply_kernel_swaps(swapped.base_model.model)
    assert swaps == {"apply_kda_kernels": 3, **({"batch_rope_index": 1} if family == "qwen3_5_moe" else {})}
    input_ids = torch.randint(3, 264, (2, 75))  # 75 tokens: a full and a partial 64-token chunk
    ref_logits, ref_grads = logits_and_lora_grads(stock, input_ids)
    assert gated_delta_calls == []
    logits, grads = logits_and_lora_grads(swapped, input_ids)
    assert len(gated_delta_calls) == 3
    assert rmse_ratio(logits, ref_logits) <= 1e-5
    assert grads.keys() == ref_grads.keys() and any("in_proj_a" in name or "in_proj_ba" in name for name in grads)
    worst = max(rmse_ratio(grads[name], ref_grads[name]) for name in grads)
    assert worst <= 1e-4, worst
