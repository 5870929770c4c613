"""Precision alignment at job start (`training.alignment_check`): on the job's first micro-batch, every operator
the family swapped (KDA or Gated DeltaNet core, sparse attention, expert compute, quantized linear) is compared
with its reference on the very inputs the job gave it, in the job's dtype (RMSE ratio, as the kernel tests measure
it), and the micro-batch's loss with the swapped operators is compared with its loss when each runs its reference
instead.

An operator is probed by wrapping the function the model calls at its call site for the two check forwards only:
the first forward records each operator's first call (inputs and output), the second replaces every operator by
its reference. The references are the oracles the tests use (kernels.*.reference / naive, the per-expert loop,
a whole-weight dequantize), so nothing here recomputes an operator its own way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moetune.api.errors import ErrorCode
import moetune.kernels.moe.linear as quantized_linear_module
import moetune.workers.families.kda as kda_module
import moetune.workers.families.mla as mla_module
from moetune.kernels.kda import l2norm
from moetune.kernels.kda.naive import naive_recurrent_kda
from moetune.kernels.sparse_attention.reference import sparse_attention_reference
from moetune.kernels.testing import rmse_ratio
from moetune.workers.errors import JobError
from moetune.workers.experts.compute import fused_expert_forward, grouped_expert_forward
from moetune.workers.experts.module import ExpertParallelExperts
from moetune.workers.settings import WorkerSettings

# Test-only (MOETUNE_TEST_PERTURB_OP): one operator whose output the check perturbs (relative noise), so a test sees the job
# fail with that operator named.
PERTURBATION = 0.05  # relative size of that noise: far beyond every tolerance below
# RMSE-ratio tolerance per job dtype (the kernel tests' bounds, with headroom for real activations)
OP_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}
LOSS_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}  # relative first-loss difference
FIRST_LOSS = "first loss"


def _kda_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, lower_bound=None):
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    o, state = naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return o.to(v.dtype), state


def _gated_delta_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Gated DeltaNet as KDA: query/key heads repeated for their value heads, each head's decay over all of K."""
    q, k = (x.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for x in (q, k))
    return _kda_reference(q, k, v, g.unsqueeze(-1).expand(*g.shape, q.shape[-1]), beta, scale, initial_state,
                          output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)


def _sparse_reference(q, k, v, indices, scale=None, gate=None, backend=None):
    return sparse_attention_reference(q, k, v, indices, q.shape[-1] ** -0.5 if scale is None else scale, gate)


def _quantized_reference(x, qweight, tile_rows=None):
    return x @ qweight.dequantize(None, x.dtype).T


@dataclass(frozen=True)
class Operator:
    name: str  # as the table and a failure name it
    sites: Callable[[torch.nn.Module], list[tuple[object, str]]]  # (owner, attribute) the model calls it through
    reference: Callable


def _module_site(module, attribute: str) -> Callable[[torch.nn.Module], list[tuple[object, str]]]:
    return lambda model: [(module, attribute)]


def _swapped_experts(model) -> list[tuple[object, str]]:
    return [(m, "compute") for m in model.modules()
            if isinstance(m, ExpertParallelExperts) and m.compute is fused_expert_forward]


OPERATORS = (
    Operator("kda", _module_site(kda_module, "chunk_kda"), _kda_reference),
    Operator("gated_delta", _module_site(kda_module, "chunk_gated_delta_rule"), _gated_delta_reference),
    Operator("sparse_attention", _module_site(mla_module, "sparse_attention"), _sparse_reference),
    Operator("experts", _swapped_experts, grouped_expert_forward),
    Operator("quantized_linear", _module_site(quantized_linear_module, "quantized_linear"), _quantized_reference),
)


def _first_tensor(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _detached(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


@contextlib.contextmanager
def _replaced(sites: list[tuple[object, str]], make: Callable[[Callable], Callable]) -> Iterator[None]:
    originals = [(owner, attribute, getattr(owner, attribute)) for owner, attribute in sites]
    try:
        for owner, attribute, original in originals:
            setattr(owner, attribute, make(original))
        yield
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)


class _Recorder:
    """Records each operator's first call (inputs and output); perturbs the output of the operator that
    MOETUNE_TEST_PERTURB_OP names (test-only)."""

    def __init__(self, perturb: str | None):
        self.calls: dict[str, tuple[tuple, dict, torch.Tensor]] = {}
        self.perturb = perturb

    def wrap(self, op: Operator) -> Callable[[Callable], Callable]:
        def make(original):
            def recorded(*args, **kwargs):
                output = original(*args, **kwargs)
                if op.name == self.perturb:
                    first = _first_tensor(output)
                    noisy = first + PERTURBATION * first.std() * torch.randn_like(first)
                    output = (noisy, *output[1:]) if isinstance(output, tuple) else noisy
                if op.name not in self.calls:
                    self.calls[op.name] = (tuple(_detached(a) for a in args),
                                           {k: _detached(v) for k, v in kwargs.items()},
                                           _first_tensor(output).detach().clone())
                return output
            return recorded
        return make


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def check_alignment(model: torch.nn.Module, loss: Callable[[], torch.Tensor], dtype: torch.dtype,
                    worst: Callable[[list[float]], list[float]] = lambda values: values) -> list[dict]:
    """The alignment table of `model` on one micro-batch: a row per swapped operator the forward reached
    ({op, rmse_ratio, tolerance, ok}) and the first-loss row ({op: "first loss", loss, reference_loss,
    relative_diff, tolerance, ok}). `loss()` runs the micro-batch's forward (no gradient needed); `worst` reduces
    the measured errors over ranks (every rank runs both forwards: expert-parallel ranks exchange tokens), so all
    ranks agree on the verdict; the loss row's losses are this rank's."""
    recorder = _Recorder(WorkerSettings().test_perturb_op)
    sites = {op.name: op.sites(model) for op in OPERATORS}
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for op in OPERATORS:
            stack.enter_context(_replaced(sites[op.name], recorder.wrap(op)))
        kernels_loss = float(loss())
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for op in OPERATORS:
            stack.enter_context(_replaced(sites[op.name], lambda original, ref=op.reference: ref))
        reference_loss = float(loss())
    errors = []
    with torch.no_grad():
        for op in OPERATORS:
            if op.name in recorder.calls:
                args, kwargs, output = recorder.calls[op.name]
                errors.append(rmse_ratio(output, _first_tensor(op.reference(*args, **kwargs))))
            else:
                errors.append(-1.0)  # not reached on this rank: the worst over ranks says whether any reached it
    *errors, loss_error = worst([*errors, _relative(kernels_loss, reference_loss)])
    tolerance = OP_TOLERANCE.get(dtype, OP_TOLERANCE[torch.bfloat16])
    rows = [{"op": op.name, "rmse_ratio": error, "tolerance": tolerance, "ok": error <= tolerance}
            for op, error in zip(OPERATORS, errors) if error >= 0]
    loss_tolerance = LOSS_TOLERANCE.get(dtype, LOSS_TOLERANCE[torch.bfloat16])
    rows.append({"op": FIRST_LOSS, "loss": kernels_loss, "reference_loss": reference_loss,
                 "relative_diff": loss_error, "tolerance": loss_tolerance, "ok": loss_error <= loss_tolerance})
    return rows


def _describe(rows: list[dict]) -> str:
    parts = [f"{r['op']} rmse ratio {r['rmse_ratio']:.2e} (tolerance {r['tolerance']:.0e})" for r in rows
             if "rmse_ratio" in r]
    loss = rows[-1]
    parts.append(f"first loss {loss['loss']:.6g} vs {loss['reference_loss']:.6g} with reference operators "
                 f"(relative {loss['relative_diff']:.2e}, tolerance {loss['tolerance']:.0e})")
    return "; ".join(parts)


def verdict(rows: list[dict], mode: bool | str, seconds: float) -> tuple[str, str, JobError | None]:
    """(event level, event message, the job's error or None) of an alignment table under
    `training.alignment_check` `mode` (True fails the job, "warn" only warns)."""
    failed, text = [row["op"] for row in rows if not row["ok"]], _describe(rows)
    if not failed:
        return "info", f"Precision alignment passed ({seconds:.1f} s): {text}", None
    names = ", ".join(failed)
    if mode != "warn":
        return "error", f"Precision alignment FAILED for {names} ({seconds:.1f} s): {text}", JobError(
            ErrorCode.alignment_failed, f"Precision alignment failed for {names} on the first micro-batch: {text}",
            "training.alignment_check")
    return "warn", f"Precision alignment off for {names} ({seconds:.1f} s; alignment_check: warn): {text}", None
