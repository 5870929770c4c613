"""The chunked PyTorch KDA and the dispatch, against the token-by-token oracle: output, final state and every
gradient (q, k, v, g, β, initial state)."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels.kda import (
    chunk_gated_delta_rule,
    chunk_kda,
    chunk_kda_torch,
    l2norm,
    naive_recurrent_kda,
    recurrent_kda,
)
from moetune.kernels.kda.chunked import _DecayedProducts
from tests.support.kda_cases import (
    BF16_TOL,
    FP32_TOL,
    NAMES,
    as_fp32,
    make_inputs,
    rmse_ratio,
    run_with_grads,
)

KEYS = ("o", "final", *(f"d{n}" for n in NAMES))


def assert_close(ours, ref, tol):
    errors = {key: rmse_ratio(ours[key], ref[key]) for key in KEYS}
    assert all(torch.isfinite(ours[key]).all() for key in KEYS)
    assert max(errors.values()) <= tol, errors


@pytest.mark.parametrize("seq_len,chunk_size", [(77, 64), (50, 32), (16, 16)])
def test_chunked_matches_oracle_fp32(seq_len, chunk_size):
    inputs = make_inputs(2, seq_len, 3, 32, 48)
    ref = run_with_grads(naive_recurrent_kda, inputs)
    ours = run_with_grads(lambda *a, **kw: chunk_kda_torch(*a, chunk_size=chunk_size, **kw), inputs)
    assert_close(ours, ref, FP32_TOL)


def test_strong_gates_stay_finite():
    # log-decays down to -30 per token: exp(Γ_r)·exp(−Γ_i) over a chunk would overflow fp32 many times over.
    inputs = make_inputs(1, 70, 2, 16, 16, gate_scale=30.0)
    assert_close(run_with_grads(chunk_kda_torch, inputs), run_with_grads(naive_recurrent_kda, inputs), FP32_TOL)


@pytest.mark.parametrize("gate_scale", [1.0, 30.0])
def test_decayed_products_own_backward(gate_scale):
    """The intra-chunk products (recursive halving, hand-written backward) against their pairwise definition, and
    their backward against finite differences; at gate 30 a factored exp(Γ_r)·exp(−Γ_i) would overflow."""
    gen = torch.Generator().manual_seed(0)
    size, dim = 16, 3
    xs, y = (torch.randn(*lead, size, dim, generator=gen, dtype=torch.float64) for lead in ((2, 2), (2,)))
    gamma = (-torch.rand(2, size, dim, generator=gen, dtype=torch.float64) * gate_scale).cumsum(-2)
    pairwise = (gamma[..., :, None, :] - gamma[..., None, :, :]).masked_fill(
        ~torch.ones(size, size, dtype=torch.bool).tril()[..., None], float("-inf")).exp()
    expected = torch.einsum("nbrd,bid,brid->nbri", xs, y, pairwise)
    torch.testing.assert_close(_DecayedProducts.apply(xs, y, gamma), expected, rtol=1e-12, atol=1e-12)
    args = [t.requires_grad_() for t in (xs, y, gamma)]
    assert torch.autograd.gradcheck(_DecayedProducts.apply, args)


def test_chunk_size_must_be_a_power_of_two():
    inputs = make_inputs(1, 8, 1, 16, 16)
    with pytest.raises(ValueError, match="power of two"):
        chunk_kda_torch(*(inputs[n] for n in NAMES[:5]), chunk_size=48)


def test_chunked_matches_oracle_bf16():
    inputs = make_inputs(2, 77, 2, 32, 32, dtype=torch.bfloat16)
    ours = run_with_grads(chunk_kda_torch, inputs)
    assert ours["o"].dtype == torch.bfloat16 and ours["dq"].dtype == torch.bfloat16
    assert_close(ours, run_with_grads(naive_recurrent_kda, as_fp32(inputs)), BF16_TOL)


def test_packed_sequences_with_empty_segments():
    cu_seqlens = torch.tensor([0, 0, 37, 37, 100, 130])  # two zero-length segments, lengths off the chunk grid
    inputs = make_inputs(1, 130, 2, 16, 24, n_states=5)
    ref = run_with_grads(naive_recurrent_kda, inputs, cu_seqlens)
    ours = run_with_grads(chunk_kda_torch, inputs, cu_seqlens)
    assert_close(ours, ref, FP32_TOL)
    # An empty segment passes its state through, and the gradient of its final state lands on its h0.
    for empty in (0, 2):
        torch.testing.assert_close(ours["final"][empty], inputs["h0"][empty].detach())
        assert ours["dh0"][empty].abs().sum() > 0


def test_packing_equals_separate_calls():
    inputs = make_inputs(1, 90, 2, 16, 16, n_states=2)
    packed, _ = chunk_kda_torch(*(inputs[n] for n in NAMES[:5]), initial_state=inputs["h0"],
                                cu_seqlens=torch.tensor([0, 40, 90]))
    for n, (bos, eos) in enumerate([(0, 40), (40, 90)]):
        alone, _ = chunk_kda_torch(*(inputs[x][:, bos:eos] for x in NAMES[:5]), initial_state=inputs["h0"][n : n + 1])
        torch.testing.assert_close(packed[:, bos:eos], alone)


def test_segments_chain_through_the_state():
    """A long sequence processed in two calls, the first's final state seeding the second, equals one call."""
    inputs = make_inputs(1, 100, 2, 16, 16)
    args = [inputs[n] for n in NAMES[:5]]
    whole, whole_final = chunk_kda_torch(*args, initial_state=inputs["h0"], output_final_state=True)
    first, mid = chunk_kda_torch(*(x[:, :45] for x in args), initial_state=inputs["h0"], output_final_state=True)
    second, final = chunk_kda_torch(*(x[:, 45:] for x in args), initial_state=mid, output_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole)
    torch.testing.assert_close(final, whole_final)


def test_dispatch_normalises_and_matches_transformers_reference():
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
    )

    inputs = make_inputs(2, 40, 2, 16, 16)
    q, k = (inputs[n].detach() * 3.0 for n in ("q", "k"))  # not unit norm: the kernel normalises
    args = (q, k, inputs["v"].detach(), inputs["g"].detach(), inputs["beta"].detach())
    ours, ours_final = chunk_kda(*args, initial_state=inputs["h0"].detach(), output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
    ref, ref_final = chunk_kimi_delta_attention(*args, initial_state=inputs["h0"].detach(), output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    assert rmse_ratio(ours, ref) <= FP32_TOL and rmse_ratio(ours_final, ref_final) <= FP32_TOL
    torch.testing.assert_close(l2norm(q).norm(dim=-1), torch.ones(2, 40, 2), atol=1e-5, rtol=0)


def test_gated_delta_rule_matches_transformers_reference():
    """Gated DeltaNet (one decay per head, two value heads per query/key head, q and k unnormalised) against
    transformers' torch_chunk_gated_delta_rule: output, final state and every gradient; 70 tokens at K = 16 run
    chunks of 16 (default_chunk_size), transformers' of 64."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    q, k = (3 * torch.randn(2, 70, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 70, 4, 8, generator=gen)
    g = -torch.rand(2, 70, 4, generator=gen) * 4
    beta, h0 = torch.rand(2, 70, 4, generator=gen), torch.randn(2, 4, 16, 8, generator=gen)
    results = []
    for fn in (torch_chunk_gated_delta_rule, chunk_gated_delta_rule):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, final = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
        ((o * o.cos()).sum() + final.sin().sum()).backward()
        results.append([o, final, *(x.grad for x in leaves)])
    assert max(rmse_ratio(ours, ref) for ours, ref in zip(results[1], results[0])) <= 1e-5


@pytest.mark.parametrize("tokens", [1, 3])
def test_recurrent_step_equals_the_oracle_with_no_loop_over_rows(tokens):
    """Generation's step (recurrent_kda on CPU) gives the oracle's outputs and final states bit for bit, q and k
    normalised by the step; its operators do not grow with the number of rows (every row moves at once)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for rows in (2, 6):  # (einsum takes another path for a single row)
        x = {n: t.detach() for n, t in make_inputs(rows, tokens, 3, 16, 24, gate_scale=4.0).items()}
        q, k = 3 * x["q"], 2 * x["k"]
        with CountOps() as ops:
            o, final = recurrent_kda(q, k, x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
        counts.append(ops.count)
        want_o, want_final = naive_recurrent_kda(l2norm(q), l2norm(k), x["v"], x["g"], x["beta"],
                                                 initial_state=x["h0"], output_final_state=True)
        assert torch.equal(o, want_o) and torch.equal(final, want_final)
    assert counts[0] == counts[1], counts


def test_packing_rejects_a_batch():
    inputs = make_inputs(2, 8, 1, 16, 16)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_kda(*(inputs[n] for n in NAMES[:5]), cu_seqlens=torch.tensor([0, 4, 8]))


def test_the_cuda_kernel_setting_chooses_fla_or_moetunes_own(monkeypatch):
    """fla stays out of CPU environments (transformers dispatches to it whenever importable), so without it the
    default is moetune's Triton KDA; MOETUNE_KDA_KERNEL names either, anything else is refused by name."""
    import importlib.util

    from moetune.kernels.kda import KERNEL_SETTING, cuda_kda_kernel, recurrent_kda_kernel
    from moetune.kernels.kda.triton_kda import chunk_kda_triton

    assert importlib.util.find_spec("fla") is None
    monkeypatch.delenv(KERNEL_SETTING, raising=False)
    assert cuda_kda_kernel().__wrapped__ is chunk_kda_triton  # behind chunk_kda's q/k normalisation
    monkeypatch.setenv(KERNEL_SETTING, "moetune")
    assert cuda_kda_kernel().__wrapped__ is chunk_kda_triton
    monkeypatch.setenv(KERNEL_SETTING, "flash")
    with pytest.raises(ValueError, match="MOETUNE_KDA_KERNEL='flash'"):
        cuda_kda_kernel()
    monkeypatch.setenv(KERNEL_SETTING, "fla")
    with pytest.raises(ModuleNotFoundError, match="fla"):  # asked for, not installed: no silent fallback
        cuda_kda_kernel()
    with pytest.raises(ModuleNotFoundError, match="fla"):  # generation's step too
        recurrent_kda_kernel("cuda")
