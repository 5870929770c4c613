"""comm.mla_context on 4 gloo ranks (first, middle and last slices): keys and values gathered from every rank's slice,
then each rank's queries attending over their own sequence's keys up to themselves: each rank's output and the
gradients of its slice's queries, keys and values equal the unsplit causal attention's (each packed sequence on its
own), with and without packed sequences, the value narrower than the key as in MLA."""

import os

import pytest
import torch
import torch.nn.functional as F

from bench.support.harness import launch
from moetune.kernels.kda.context_slices import SliceLayout

T, H, DK, DV = 16, 2, 8, 6
PACKINGS = {"unpacked": None, "packed": (0, 3, 9, 9, 16)}  # sequences across both cuts of 4 ranks, one empty


def case(cu):
    torch.manual_seed(0)
    batch = 1 if cu else 2
    return (torch.randn(batch, H, T, DK), torch.randn(batch, H, T, DK), torch.randn(batch, H, T, DV),
            torch.randn(batch, T, H, DV))  # query, key, value, the loss's probe


def _ranks(rank: int, world: int, out_dir: str) -> None:
    from moetune.workers.comm.mla_context import GatheredKeys, attend_over_row

    results = {}
    for name, cu in PACKINGS.items():
        layout = SliceLayout.even(T, world, rank, cu)
        mine = slice(layout.start, layout.end)
        *tensors, probe = case(cu)
        leaves = [x[:, :, mine].clone().requires_grad_() for x in tensors]
        key, value = GatheredKeys(layout).update(leaves[1], leaves[2], layer_idx=0)
        out = attend_over_row(leaves[0], key, value, layout, scaling=0.3)
        (out * probe[:, mine]).sum().backward()
        results[name] = {"out": out.detach(), "grads": [x.grad for x in leaves]}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _unsplit(cu):
    *leaves, probe = case(cu)
    for x in leaves:
        x.requires_grad_()
    query, key, value = leaves
    cuts = cu or (0, T)
    out = torch.cat([F.scaled_dot_product_attention(query[:, :, b:e], key[:, :, b:e], value[:, :, b:e],
                                                    is_causal=True, scale=0.3)
                     for b, e in zip(cuts, cuts[1:]) if b < e], dim=2).transpose(1, 2)
    (out * probe).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def close(got, want):
    return (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [4])
def test_each_rank_attends_over_the_gathered_row_as_the_unsplit_attention(tmp_path, world):
    launch(_ranks, world, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name, cu in PACKINGS.items():
        want_out, want_grads = _unsplit(cu)
        for r, result in enumerate(rank[name] for rank in ranks):
            mine = slice(r * T // world, (r + 1) * T // world)
            assert close(result["out"], want_out[:, mine]), (name, r)
            for i, (got, want) in enumerate(zip(result["grads"], want_grads)):
                assert close(got, want[:, :, mine]), (name, r, i)


def test_keys_are_gathered_only_from_equal_slices():
    from moetune.workers.comm.mla_context import GatheredKeys

    with pytest.raises(ValueError, match="must be equal"):
        GatheredKeys(SliceLayout((0, 6, 16), rank=0))
