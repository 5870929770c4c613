"""Kimi K3 split over 2 and 4 gloo context-parallel ranks (workers.families.context): the tiny model of the
released shape (KDA and gated MLA layers, Attention Residuals, a latent MoE), with its kernel swaps and LoRA on
every projection, run on each rank's contiguous slice of the rows: each rank's logits equal the unsplit model's for
its tokens, and the ranks' LoRA gradients sum to the unsplit ones (of a loss over every token)."""

import os

import pytest
import torch

from bench.support.harness import launch
from moetune.kernels.kda.context_slices import SliceLayout

T, BATCH = 16, 2
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj", "q_proj", "k_proj",
           "v_proj", "f_a_proj", "f_b_proj", "b_proj", "gate_proj", "up_proj", "down_proj"]


def k3():
    """The tiny K3 with its swaps and LoRA (B random too, so every factor has a gradient): the same weights in every
    process."""
    from peft import LoraConfig, inject_adapter_in_model

    from bench.support.tiny_models import plain_model
    from moetune.workers.families import REGISTRY

    family = REGISTRY["kimi_k3"]
    model = plain_model(family)
    assert family.apply_kernel_swaps(model) == {"apply_kda_kernels": 2, "apply_segment_attention": 2}
    torch.manual_seed(1)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False),
                            model.language_model)
    return model


def case():
    torch.manual_seed(2)
    return torch.randint(3, 272, (BATCH, T)), torch.randn(BATCH, T, 272)  # token ids, the loss's probe


def lora_grads(model) -> dict:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if "lora_" in name}
    assert grads and all(g is not None for g in grads.values())
    return grads


def _ranks(rank: int, world: int, out_dir: str) -> None:
    from moetune.workers.families.context import context_parallel

    model = k3()
    layout = SliceLayout.even(T, world, rank)
    mine = slice(layout.start, layout.end)
    ids, probe = case()
    positions = torch.arange(layout.start, layout.end).expand(BATCH, -1)
    with context_parallel(model, layout):
        logits = model(input_ids=ids[:, mine], position_ids=positions).logits
        (logits * probe[:, mine]).sum().backward()
    torch.save({"logits": logits.detach(), "lora": lora_grads(model)}, os.path.join(out_dir, f"rank{rank}.pt"))


def close(got, want, tolerance=5e-5):  # fp32: the worst, KDA's gate factors, 2.2e-5
    return (got - want).abs().max() <= tolerance * want.abs().max()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_k3_split_over_context_parallel_ranks_equals_the_unsplit_model(tmp_path, world):
    launch(_ranks, world, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    model = k3()
    ids, probe = case()
    logits = model(input_ids=ids).logits
    (logits * probe).sum().backward()
    for r, rank in enumerate(ranks):
        mine = slice(r * T // world, (r + 1) * T // world)
        assert close(rank["logits"], logits[:, mine]), r
    for key, want in lora_grads(model).items():
        assert close(sum(rank["lora"][key] for rank in ranks), want), key


def test_a_layer_without_a_context_parallel_path_is_refused_before_the_forward():
    from moetune.workers.families.context import context_parallel

    model = k3()
    with pytest.raises(NotImplementedError, match="packed"):
        with context_parallel(model, SliceLayout.even(T, 2, 0, cu_seqlens=(0, 5, T))):
            pass
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="kernel swaps"):
        with context_parallel(plain, SliceLayout.even(T, 2, 0)):
            pass
