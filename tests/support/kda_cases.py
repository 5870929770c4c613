"""Inputs and comparison helpers shared by the KDA tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAMES = ("q", "k", "v", "g", "beta", "h0")
FP32_TOL = 0.005  # fla's bar for fp32 (RMSE ratio)
BF16_TOL = 0.01  # bf16 inputs and results, fp32 inside: what remains is the rounding of the stored results


def rmse_ratio(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """fla's error metric: RMSE of the difference over the RMS of the reference."""
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def make_inputs(batch, seq_len, heads, dk, dv, n_states=None, dtype=torch.float32, gate_scale=1.0, seed=0):
    """Unit-norm q/k, β in (0, 1), per-channel log-decays g <= 0 (`gate_scale` sets how strong), a random h0."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, seq_len, heads, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(batch, seq_len, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, seq_len, heads, dv, generator=gen)
    g = -torch.rand(batch, seq_len, heads, dk, generator=gen) * gate_scale
    beta = torch.rand(batch, seq_len, heads, generator=gen)
    h0 = torch.randn(n_states or batch, heads, dk, dv, generator=gen)
    return {name: x.to(dtype).requires_grad_() for name, x in zip(NAMES, (q, k, v, g, beta, h0))}


def run_with_grads(fn, inputs, cu_seqlens=None, seed=1):
    """Output, final state and the gradients of every input under random output and final-state cotangents."""
    for x in inputs.values():
        x.grad = None
    o, final = fn(*(inputs[n] for n in NAMES[:5]), initial_state=inputs["h0"], output_final_state=True,
                  cu_seqlens=cu_seqlens)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device, o.dtype)
    dht = torch.randn(final.shape, generator=gen).to(final.device)
    ((o.float() * do.float()).sum() + (final * dht).sum()).backward()
    return {"o": o, "final": final, **{f"d{n}": inputs[n].grad for n in NAMES}}


def as_fp32(inputs):
    """The same values in fp32, as fresh leaves (the oracle runs on the rounded low-precision values)."""
    return {n: x.detach().float().requires_grad_() for n, x in inputs.items()}


def fla_launch_failures(op: str) -> dict:
    """Run only in a child process where fla is importable (never in the suite's own: transformers would dispatch
    to it). The Triton launches fla makes for moetune's CUDA kernel of `op` ("kda", "kda_bounded": with glm5_next's
    gate lower bound, "gated_delta": two value heads per query/key head; forward and backward; "kda_decode": Kimi
    K3's generation step, three rows of one token on their fp32 states, with its fp32 β) on the dtypes the models
    hand it (bf16 q, k, v and β, fp32 gates; q and k unnormalised), captured on CPU tensors and each lowered to
    Triton IR for sm_90, where operand dtype errors arise. {"kernels": launched, "failures": {kernel: error}}."""
    from moetune.kernels.compile_check import captured_launches, launch_source
    from moetune.kernels.kda import gated_delta_kernel, kda_kernel, recurrent_kda_kernel

    decode = op == "kda_decode"
    (rows, t), heads, dim, bf16 = (3, 1) if decode else (1, 128), 2, 64, torch.bfloat16
    value_heads = 2 * heads if op == "gated_delta" else heads
    gate_shape = (rows, t, value_heads) if op == "gated_delta" else (rows, t, heads, dim)
    q, k = (torch.zeros(rows, t, heads, dim, dtype=bf16, requires_grad=True) for _ in range(2))
    v = torch.zeros(rows, t, value_heads, dim, dtype=bf16, requires_grad=True)
    g = torch.zeros(gate_shape, requires_grad=True)
    beta = torch.zeros(rows, t, value_heads, dtype=torch.float32 if decode else bf16, requires_grad=True)
    bound = {"lower_bound": -5.0} if op == "kda_bounded" else {}
    with captured_launches() as launches:
        if decode:
            recurrent_kda_kernel("cuda")(q, k, v, g, beta, initial_state=torch.zeros(rows, heads, dim, dim),
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        else:
            kernel = gated_delta_kernel("cuda") if op == "gated_delta" else kda_kernel("cuda")
            o, _ = kernel(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **bound)
            torch.autograd.grad(o, (q, k, v, g, beta), torch.zeros_like(o))
    failures, built = {}, set()
    for launch in launches:  # every autotune config, many alike: each distinct specialisation once
        source, options = launch_source(launch)
        if source.hash() in built:
            continue
        built.add(source.hash())
        error = _sm90_ir_error(source, options)
        if error:
            failures[launch.kernel.__name__] = error
    return {"kernels": sorted({launch.kernel.__name__ for launch in launches}), "failures": failures}


def fla_decode_errors() -> dict:
    """Run only in a child process where fla is importable, under TRITON_INTERPRET=1 (fla's kernels then run on CPU
    tensors). moetune's CUDA decode step (kernels.kda.recurrent_kda_kernel("cuda"): fla's fused_recurrent_kda)
    against its CPU one on the same rows: the largest absolute difference of the outputs and of the final states,
    for one token a row and for a few."""
    from moetune.kernels.kda import recurrent_kda_kernel

    errors = {}
    for rows, t in ((3, 1), (2, 3)):
        x = {name: value.detach() for name, value in make_inputs(rows, t, 2, 16, 32, gate_scale=4.0).items()}
        args = (3 * x["q"], 2 * x["k"], x["v"], x["g"], x["beta"])  # q and k unnormalised: the step normalises them
        (o, final), (want_o, want_final) = (
            recurrent_kda_kernel(device)(*args, initial_state=x["h0"], output_final_state=True,
                                         use_qk_l2norm_in_kernel=True) for device in ("cuda", "cpu"))
        errors[f"{rows}x{t}"] = [(o - want_o).abs().max().item(), (final - want_final).abs().max().item()]
    return errors


def _sm90_ir_error(source, options) -> str | None:
    """The error lowering a launch (compile_check.launch_source) to Triton IR for sm_90 raises, if any: the front
    end, where dtypes are checked, without the minutes a full cubin build of fla's launches takes."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                       context)
    except Exception as error:  # noqa: BLE001 (Triton's CompilationError and the errors it wraps)
        return str(error).strip().splitlines()[-1]
    return None
