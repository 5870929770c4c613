"""comm.mla_context on 2 and 4 gloo ranks: Kimi K3's own MLA attention module, unchanged, with LoRA on every
projection, run on each rank's slice with the gathered keys and the slice's mask: each rank's output and its
slice's input gradient equal the unsplit module's, and the ranks' LoRA gradients sum to the unsplit ones, with and
without packed sequences (the unsplit reference runs each packed sequence on its own)."""

import os

import pytest
import torch

from bench.support.harness import launch
from moetune.kernels.kda.context_slices import SliceLayout

T = 16
PACKINGS = {"unpacked": None, "packed": (0, 3, 9, 9, 16)}  # sequences across both cuts of 4 ranks, one empty
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"]


def attention():
    """K3's MLA layer of the tiny released shape, LoRA on every projection (B random too, so every factor has a
    gradient); the same weights in every process."""
    from peft import LoraConfig, inject_adapter_in_model

    from moetune.workers.families.kimi_k3.modeling import KimiK3Attention
    from moetune.workers.families.kimi_k3.tiny import tiny_config

    config = tiny_config().text_config
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    module = KimiK3Attention(config, layer_idx=1)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False), module)
    return module


def case(cu):
    torch.manual_seed(1)
    batch = 1 if cu else 2
    return torch.randn(batch, T, 64), torch.randn(batch, T, 64)  # hidden states, the loss's probe


def lora_grads(module) -> dict:
    return {name: p.grad.clone() for name, p in module.named_parameters() if "lora_" in name}


def _ranks(rank: int, world: int, out_dir: str) -> None:
    from moetune.workers.comm.mla_context import GatheredKeys, slice_attention_mask

    results = {}
    for name, cu in PACKINGS.items():
        module = attention()
        layout = SliceLayout.even(T, world, rank, cu)
        mine = slice(layout.start, layout.end)
        hidden, probe = case(cu)
        hidden = hidden[:, mine].clone().requires_grad_()
        out = module(hidden, attention_mask=slice_attention_mask(layout, hidden.dtype), cache=GatheredKeys(layout))
        (out * probe[:, mine]).sum().backward()
        results[name] = {"out": out.detach(), "hidden": hidden.grad, "lora": lora_grads(module)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _unsplit(cu):
    module = attention()
    hidden, probe = case(cu)
    hidden.requires_grad_()
    cuts = cu or (0, T)
    out = torch.cat([module(hidden[:, b:e]) for b, e in zip(cuts, cuts[1:]) if b < e], dim=1)
    (out * probe).sum().backward()
    return out.detach(), hidden.grad, lora_grads(module)


def close(got, want):
    return (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_s_slice_of_k3_attention_equals_the_unsplit_layer(tmp_path, world):
    launch(_ranks, world, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name, cu in PACKINGS.items():
        want_out, want_hidden, want_lora = _unsplit(cu)
        for r, result in enumerate(rank[name] for rank in ranks):
            mine = slice(r * T // world, (r + 1) * T // world)
            assert close(result["out"], want_out[:, mine]), (name, r)
            assert close(result["hidden"], want_hidden[:, mine]), (name, r)
        assert len(want_lora) == 2 * len(TARGETS)
        for key, want in want_lora.items():
            assert close(sum(rank[name]["lora"][key] for rank in ranks), want), (name, key)


def test_keys_are_gathered_only_from_equal_slices():
    from moetune.workers.comm.mla_context import GatheredKeys

    with pytest.raises(ValueError, match="must be equal"):
        GatheredKeys(SliceLayout((0, 6, 16), rank=0))
