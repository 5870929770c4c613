"""kernels.kda.context_state: a sequence split into R contiguous slices, each run from the state the earlier slices'
summaries carry into it, equals the unsplit kernel, outputs and gradients (of q, k, v, g, β and the initial state,
through the summaries), with and without packed sequences. In one process: the ranks' all-gather is a stack here
(tests/workers/comm/test_kda_context.py runs it on gloo ranks)."""

import pytest
import torch
import torch.nn.functional as F

from moetune.kernels.kda import chunk_kda_torch, naive_recurrent_kda
from moetune.kernels.kda.context_slices import SliceLayout
from moetune.kernels.kda.context_state import run_slice, slice_initial_state, slice_summary

T, H, K, V = 48, 2, 8, 6
PACKINGS = {
    "unpacked": None,
    # R = 4 cuts at 12, 24, 36 (R = 2 at 24): a sequence across each cut, one across three slices (2..30 at R = 4),
    # one starting exactly at 36 (and at 24 for R = 2), an empty one
    "packed_across": (0, 2, 30, 30, 36, 41, 48),
    "packed_at_cut": (0, 5, 24, 40, 48),
}


def inputs(batch: int, gate_channels: int, seed: int = 0):
    torch.manual_seed(seed)
    q, k = (F.normalize(torch.randn(batch, T, H, K), dim=-1) for _ in range(2))
    v = torch.randn(batch, T, H, V)
    g = -torch.rand(batch, T, H, gate_channels) * 0.3
    beta = torch.rand(batch, T, H).sigmoid()
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def split_run(tensors, world, cu_seqlens, initial_state, kda=chunk_kda_torch):
    """Every rank's summary, the gather (a stack), every rank's slice from its carried state: the output row."""
    layouts = [SliceLayout.even(T, world, r, cu_seqlens) for r in range(world)]
    parts = [[x[:, lay.start:lay.end] for x in tensors] for lay in layouts]
    summaries = torch.stack([slice_summary(*p[1:], layout=lay, kda=kda) for p, lay in zip(parts, layouts)])
    return torch.cat([run_slice(*p, layout=lay, initial_state=slice_initial_state(summaries, lay, initial_state),
                                kda=kda) for p, lay in zip(parts, layouts)], dim=1)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("gate_channels", [K, 1], ids=["kda", "gated_deltanet"])
@pytest.mark.parametrize("kda", [chunk_kda_torch, naive_recurrent_kda], ids=["chunked", "naive"])
def test_split_slices_equal_the_unsplit_kernel(world, packing, gate_channels, kda):
    cu = PACKINGS[packing]
    tensors = inputs(1 if cu else 2, gate_channels)
    sequences = len(cu) - 1 if cu else 2
    initial = torch.randn(sequences, H, K, V, requires_grad=True)
    cu_tensor = None if cu is None else torch.tensor(cu)
    want, _ = chunk_kda_torch(*tensors, initial_state=initial, cu_seqlens=cu_tensor)
    got = split_run(tensors, world, cu, initial, kda)
    probe = torch.randn_like(want)
    leaves = [*tensors, initial]
    want_grads = torch.autograd.grad((want * probe).sum(), leaves)
    got_grads = torch.autograd.grad((got * probe).sum(), leaves)
    for name, w, o in zip(("o", "q", "k", "v", "g", "beta", "initial_state"), (want, *want_grads),
                          (got, *got_grads)):
        assert (o - w).abs().max() <= 1e-5 * w.abs().max(), name


def test_a_sequence_crossing_slices_does_not_start_from_zero():
    """Without the carried state (every slice from zero) the split run differs: the carry is what the test sees."""
    tensors = inputs(1, K)
    cu = PACKINGS["packed_across"]
    want, _ = chunk_kda_torch(*tensors, cu_seqlens=torch.tensor(cu))
    layouts = [SliceLayout.even(T, 4, r, cu) for r in range(4)]
    from_zero = torch.cat([run_slice(*(x[:, lay.start:lay.end] for x in tensors), layout=lay) for lay in layouts],
                          dim=1)
    assert (from_zero - want).abs().max() > 1e-2


@pytest.mark.parametrize("packing", PACKINGS)
def test_without_an_initial_state(packing):
    cu = PACKINGS[packing]
    tensors = inputs(1 if cu else 2, K)
    want, _ = chunk_kda_torch(*tensors, cu_seqlens=None if cu is None else torch.tensor(cu))
    got = split_run(tensors, 4, cu, None)
    probe = torch.randn_like(want)
    for w, o in zip(torch.autograd.grad((want * probe).sum(), tensors), torch.autograd.grad((got * probe).sum(),
                                                                                             tensors)):
        assert (o - w).abs().max() <= 1e-5 * w.abs().max()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_layout_of_a_packed_row():
    lay = SliceLayout.even(T, 4, 1, PACKINGS["packed_across"])  # tokens 12..24 inside sequence 2..30
    assert (lay.first_sequence, lay.first_sequence_start, lay.carried_from) == (1, 2, 0)
    assert lay.local_offsets == [0, 12] and lay.last_segment_start == 0
    lay = SliceLayout.even(T, 4, 3, PACKINGS["packed_across"])  # 36..48: a sequence starts at the cut
    assert (lay.first_sequence, lay.carried_from, lay.local_offsets) == (4, None, [0, 5, 12])
    with pytest.raises(ValueError, match="do not split"):
        SliceLayout.even(T, 5, 0)
