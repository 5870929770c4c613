"""comm.kda_context and comm.conv_halo on 4 gloo ranks (first, middle and last slices): each rank's output slice and the
gradients of its inputs (and the initial state's, summed over the ranks) equal the unsplit run's, with and without
packed sequences; the conv halo likewise against the unsplit per-sequence conv."""

import os

import pytest
import torch
import torch.nn.functional as F

from bench.support.harness import launch
from moetune.kernels.kda import chunk_kda_torch
from moetune.kernels.kda.context_slices import SliceLayout

T, H, K, V, D, WIDTH = 48, 2, 8, 6, 5, 4
PACKINGS = {"unpacked": None, "packed_across": (0, 2, 30, 30, 36, 41, 48), "packed_at_cut": (0, 5, 24, 40, 48)}


def kda_case(cu):
    torch.manual_seed(0)
    batch = 1 if cu else 2
    q, k = (F.normalize(torch.randn(batch, T, H, K), dim=-1) for _ in range(2))
    v = torch.randn(batch, T, H, V)
    g = -torch.rand(batch, T, H, K) * 0.3
    beta = torch.rand(batch, T, H).sigmoid()
    initial = torch.randn(len(cu) - 1 if cu else batch, H, K, V)
    return (q, k, v, g, beta), initial, torch.randn(batch, T, H, V)


def conv_case(cu):
    torch.manual_seed(1)
    return torch.randn(1 if cu else 2, T, D), torch.randn(D, WIDTH), torch.randn(1 if cu else 2, T, D)


def conv(x, weight, cu, halo=None):
    """Depthwise causal conv over x (B, T, D), each packed sequence on its own; `halo` (B, WIDTH − 1, D): the
    tokens before the first sequence (zeros without)."""
    cuts = cu or (0, x.shape[1])
    outs = []
    for n, (b, e) in enumerate(zip(cuts, cuts[1:])):
        if b == e:  # an empty packed sequence
            continue
        before = halo if n == 0 and halo is not None else x.new_zeros(x.shape[0], WIDTH - 1, x.shape[2])
        seq = torch.cat([before, x[:, b:e]], dim=1).transpose(1, 2)
        outs.append(F.conv1d(seq, weight.unsqueeze(1), groups=x.shape[2]).transpose(1, 2))
    return torch.cat(outs, dim=1)


def _ranks(rank: int, world: int, out_dir: str) -> None:
    from moetune.workers.comm import checked
    from moetune.workers.comm.conv_halo import previous_tokens
    from moetune.workers.comm.kda_context import context_parallel_kda

    results = {}
    for name, cu in PACKINGS.items():
        layout = SliceLayout.even(T, world, rank, cu)
        mine = slice(layout.start, layout.end)
        tensors, initial, probe = kda_case(cu)
        leaves = [x[:, mine].clone().requires_grad_() for x in tensors]
        initial.requires_grad_()
        o = context_parallel_kda(*leaves, layout=layout, initial_state=initial)
        (o * probe[:, mine]).sum().backward()
        results[name] = {"o": o.detach(), "grads": [x.grad for x in leaves], "initial": initial.grad}
        x, weight, probe = conv_case(cu)
        x = x[:, mine].clone().requires_grad_()
        weight.requires_grad_()
        local_cu = layout.local_offsets
        y = conv(x, weight, local_cu, previous_tokens(x, WIDTH, layout))
        (y * probe[:, mine]).sum().backward()
        results[name + "_conv"] = {"o": y.detach(), "grads": [x.grad], "initial": weight.grad}
    try:  # checked.all_gather holds gloo to NCCL's rule of one shape on every rank
        checked.all_gather(torch.empty(world, 2 + rank), torch.ones(2 + rank))
        results["mismatch"] = "ran"
    except checked.CollectiveMismatch as error:
        results["mismatch"] = str(error)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _unsplit(name, cu):
    if name.endswith("_conv"):
        x, weight, probe = (t.requires_grad_() for t in conv_case(cu))
        y = conv(x, weight, cu)
        grads = torch.autograd.grad((y * probe).sum(), [x, weight])
        return y, grads[:1], grads[1]
    tensors, initial, probe = kda_case(cu)
    leaves = [x.requires_grad_() for x in (*tensors, initial)]
    o, _ = chunk_kda_torch(*leaves[:5], initial_state=leaves[5],
                           cu_seqlens=None if cu is None else torch.tensor(cu))
    grads = torch.autograd.grad((o * probe).sum(), leaves)
    return o, grads[:5], grads[5]


def close(got, want):
    return (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [4])
def test_context_parallel_slices_equal_the_unsplit_run(tmp_path, world):
    launch(_ranks, world, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for rank in ranks:
        assert "rank 0: all_gather(float32[2]); rank 1: all_gather(float32[3])" in rank.pop("mismatch")
    for name in ranks[0]:
        want_o, want_grads, want_shared = _unsplit(name, PACKINGS[name.removesuffix("_conv")])
        for r, result in enumerate(rank[name] for rank in ranks):
            mine = slice(r * T // world, (r + 1) * T // world)
            assert close(result["o"], want_o[:, mine]), (name, r)
            for i, (got, want) in enumerate(zip(result["grads"], want_grads)):
                assert close(got, want[:, mine]), (name, r, i)
        # the initial state (the conv's weight) is every rank's input: the ranks' gradients sum to the unsplit one
        assert close(sum(rank[name]["initial"] for rank in ranks), want_shared), name
