"""The context-parallel KDA check of bench/gpu_check.py, run on each rank of a CP group: one packed row (a sequence
across every cut) of KDA at Kimi K3's head size, split into the ranks' equal slices, through moetune's CP
(workers.comm.kda_context over the device's chunk_kda, as the model's layers call it) and, where fla is installed on
CUDA, through fla's own (`chunk_kda(..., cp_context=build_cp_context(...))`). Each is compared with the unsplit
kernel over the whole row on the rank's slice: its output and the gradients of q, k, v, g and β (each rank's slice
gradient takes the later ranks' share through the exchange's backward); each is timed forward + backward."""

from __future__ import annotations

import functools
import json
import os

import torch


def _row(seq: int, heads: int, dim: int, device) -> list[torch.Tensor]:
    """q, k, v, β in bf16 (fp32 on CPU), the gates fp32 in [-0.1, 0), as the model layers hand them: the same on
    every rank."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, seq, heads, dim, generator=gen, device=device).to(dtype) for _ in range(3))
    g = -0.1 * torch.rand(1, seq, heads, dim, generator=gen, device=device)
    beta = torch.rand(1, seq, heads, generator=gen, device=device).to(dtype)
    return [q, k, v, g, beta]


def context_kda_check(rank: int, world: int, seq: int, heads: int, dim: int, out_dir: str, device=None) -> None:
    """Writes rank<r>.json: per implementation, the worst RMSE ratio against the unsplit kernel on this slice and the
    split run's milliseconds, beside the unsplit kernel's on the whole row."""
    from moetune.kernels.kda import chunk_kda, packed_offsets
    from moetune.kernels.kda.context_slices import SliceLayout
    from moetune.kernels.testing import rmse_ratio
    from bench.gpu_check import Setting
    from moetune.workers.comm.kda_context import context_parallel_kda

    device = device or torch.device("cpu")
    cuts = (0, seq // (2 * world), seq - seq // (3 * world), seq)  # the middle sequence crosses every cut
    layout = SliceLayout.even(seq, world, rank, cuts)
    mine = slice(layout.start, layout.end)
    whole = [x.requires_grad_() for x in _row(seq, heads, dim, device)]
    offsets = packed_offsets(torch.tensor(cuts), device)
    cotangent = torch.randn(1, seq, heads, dim, generator=torch.Generator(device=device).manual_seed(1),
                            device=device).to(whole[2].dtype)
    timer, results = Setting(dry=device.type != "cuda"), {}  # every rank times alike: the runs hold collectives

    def unsplit(kda=chunk_kda):
        out, _ = kda(*whole, use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
        return out, torch.autograd.grad(out, whole, cotangent)

    def compare(name: str, split, kda=chunk_kda) -> None:
        part = [x.detach()[:, mine].clone().requires_grad_() for x in whole]

        def run():
            out = split(part)
            return out, torch.autograd.grad(out, part, cotangent[:, mine])

        want_out, want_grads = unsplit(kda)
        got_out, got_grads = run()
        errors = [rmse_ratio(got.float(), want[:, mine].float())
                  for got, want in zip((got_out, *got_grads), (want_out, *want_grads))]
        results[name] = {"rmse": max(errors), "split_ms": timer.seconds(run, reps=5) * 1e3,
                         "unsplit_ms": timer.seconds(lambda: unsplit(kda), reps=5) * 1e3}

    kda = functools.partial(chunk_kda, use_qk_l2norm_in_kernel=True)
    compare("moetune", lambda part: context_parallel_kda(*part, layout, kda=kda))
    if device.type == "cuda" and _fla_installed():
        compare("fla", _fla_split(layout, offsets), kda=_fla_unsplit)
    else:
        results["fla"] = {"skipped": "fla's context parallel runs on CUDA only, with fla installed"}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _fla_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("fla") is not None


def _fla_unsplit(q, k, v, g, beta, use_qk_l2norm_in_kernel, cu_seqlens):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def _fla_split(layout, offsets):
    """fla's CP run of a rank's slice: its context from the whole row's offsets over the default group."""
    import torch.distributed as dist
    from fla.ops.cp import build_cp_context
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    context = build_cp_context(offsets, group=dist.group.WORLD)

    def split(part):
        out, _ = fla_chunk_kda(*part, use_qk_l2norm_in_kernel=True, cp_context=context)
        return out

    return split
