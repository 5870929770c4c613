"""Compile every Triton launch the CUDA path makes for sm_90 (H100/H200) on any machine, and read each cubin's
registers, spills and shared memory.

The launches are not described by hand: `captured_launches` runs the real host code (on meta or CPU tensors) and
records each `kernel[grid](...)` call instead of running it, every autotune config of an autotuned kernel
included. `compile_launch` then types each argument as Triton's launcher specialises it at run time
(`native_specialize_impl`: integers equal to 1 become constants, integers and pointers divisible by 16 carry
`tt.divisibility`), so the cubin is the one a GPU would build. Run it without TRITON_INTERPRET (the interpreter
replaces @triton.jit kernels); `kernels.testing.compile_in_subprocess` gives a clean process.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one block may use on H100/H200
MAX_REGISTERS = 255
# Spills (stack bytes per thread) the kernels have today, measured with Triton 3.9 at the SM90_CASES shapes: the
# budget a change must not exceed. Every other kernel must not spill. KDA holds whole [K, V] states per program (the
# known rewrite: fla-style chunk-parallel KDA); sparse attention's key-major dK/dV at latent widths holds [16, 512]
# fp32 accumulators for keys and values (16-64 B; 216 B with a LoRA adapter's latent in the tail) (its query-major
# pass holds the same ones without spilling, built with two stages), its forward 8 B in one config; the INT4 / MXFP4
# dequantizing GEMM spills a few bytes at 255 registers.
STACK_BUDGET = {"kda_fwd_kernel": 1024, "kda_bwd_kernel": 12_336, "_sparse_attn_fwd": 8, "_sparse_attn_bwd_dkv": 216,
                "_grouped_lora_mm": 96}


@dataclass
class Launch:
    kernel: object  # the JITFunction
    args: tuple
    kwargs: dict  # constexprs by name, num_warps, num_stages


@contextmanager
def captured_launches():
    """Yields a list that collects every Triton launch made inside the block; nothing runs on a device."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def jit_run(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    def tuned_run(self, *args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        for config in self.configs:
            launches.append(Launch(self.fn, args, {**kwargs, **config.all_kwargs()}))

    saved = JITFunction.run, Autotuner.run
    JITFunction.run, Autotuner.run = jit_run, tuned_run
    try:
        yield launches
    finally:
        JITFunction.run, Autotuner.run = saved


def launch_source(launch: Launch):
    """(ASTSource, options) of `launch`, specialised as Triton's launcher would specialise these arguments."""
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl

    kernel, options = launch.kernel, {"num_warps": 4, "num_stages": 3}
    values = dict(zip(kernel.arg_names, launch.args))
    for key, value in launch.kwargs.items():
        is_option = key in ("num_warps", "num_stages", "num_ctas", "maxnreg")
        if is_option:
            options[key] = value
        if not is_option or key in kernel.arg_names:  # an option a kernel also takes (fla's num_stages) gets both
            values[key] = value
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = values[param.name] if param.name in values else param.default
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                           not param.do_not_specialize_on_alignment)
        if kind == "constexpr":  # an integer 1 or None
            signature[param.name], constexprs[(i,)] = "constexpr", key
            continue
        signature[param.name] = kind
        if key and "D" in key:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), options


def compile_launch(launch: Launch):
    """The sm_90 build of `launch` (see launch_source)."""
    import triton
    from triton.backends.compiler import GPUTarget

    source, options = launch_source(launch)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(compiled) -> dict:
    """registers and stack (spill) bytes per thread from `cuobjdump -res-usage`, shared bytes from the metadata."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    return {"registers": int(found.get("REG", 0)), "stack_bytes": int(found.get("STACK", 0)),
            "local_bytes": int(found.get("LOCAL", 0)), "shared_bytes": compiled.metadata.shared}


def describe(launch: Launch) -> str:
    meta = {k: v for k, v in launch.kwargs.items() if k.isupper() or k.startswith("num_")}
    return f"{launch.kernel.__name__}({', '.join(f'{k}={v}' for k, v in meta.items())})"


def build_all(case_launches: dict[str, list[Launch]]) -> list[dict]:
    """One row per distinct launch variant: case, kernel and constexprs, and its resources."""
    rows, seen = [], set()
    for case, launches in case_launches.items():
        for launch in launches:
            source, options = launch_source(launch)
            key = (source.hash(), tuple(sorted(options.items())))
            if key in seen:
                continue
            seen.add(key)
            rows.append({"case": case, "kernel": launch.kernel.__name__, "launch": describe(launch),
                         **resources(compile_launch(launch))})
    return rows


def over_budget(row: dict) -> list[str]:
    """What a built variant exceeds: shared memory, registers, spills beyond its kernel's STACK_BUDGET."""
    problems, max_stack_bytes = [], STACK_BUDGET.get(row["kernel"], 0)
    if row["shared_bytes"] > SM90_SHARED_BYTES:
        problems.append(f"shared {row['shared_bytes']} B > {SM90_SHARED_BYTES}")
    if row["registers"] > MAX_REGISTERS:
        problems.append(f"{row['registers']} registers")
    if row["stack_bytes"] > max_stack_bytes:
        problems.append(f"{row['stack_bytes']} B stack (spills) > {max_stack_bytes}")
    return problems


def _moe_launches(hidden: int, out: int, rank: int, weight: str = "dense", device="meta") -> list[Launch]:
    """Forward and backward of one grouped LoRA GEMM (kernels.moe, Triton) in bf16: [N, hidden] -> [N, out]."""
    import torch

    from moetune.kernels.moe import moe_lora_grouped
    from moetune.kernels.quant import quantize_fp8_block, quantize_int4, quantize_mxfp4

    experts, bf16 = 4, torch.bfloat16
    counts = torch.tensor([64, 0, 100, 92], device=device)
    x = torch.empty(256, hidden, dtype=bf16, device=device, requires_grad=True)
    if weight == "dense":
        w = torch.empty(experts, hidden, out, dtype=bf16, device=device)
    else:  # quantized on CPU (the quantizers compute), the codes' layout and dtypes are what matter
        quantize = {"fp8": quantize_fp8_block, "int4": quantize_int4, "mxfp4": quantize_mxfp4}[weight]
        w = quantize(torch.zeros(experts, out, hidden)).to(device)
    a = torch.empty(experts, hidden, rank, dtype=bf16, device=device, requires_grad=True)
    b = torch.empty(experts, rank, out, dtype=bf16, device=device, requires_grad=True)
    with captured_launches() as launches:
        y = moe_lora_grouped(x, counts, w, a, b, 2.0, backend="triton")
        torch.autograd.grad(y, (x, a, b), torch.empty_like(y))
    return launches


def _kda_launches(heads: int, dk: int, dv: int) -> list[Launch]:
    """KDA forward (with and without the states a backward needs) and backward (Triton), bf16 in, fp32 gates."""
    import torch

    from moetune.kernels.kda.triton_kda import chunk_kda_triton

    t, bf16 = 128, torch.bfloat16
    q, k = (torch.zeros(1, t, heads, dk, dtype=bf16, requires_grad=True) for _ in range(2))
    v = torch.zeros(1, t, heads, dv, dtype=bf16, requires_grad=True)
    g = torch.zeros(1, t, heads, dk, requires_grad=True)
    beta = torch.zeros(1, t, heads, dtype=bf16, requires_grad=True)
    with captured_launches() as launches:
        with torch.no_grad():
            chunk_kda_triton(q, k, v, g, beta)
        o, _ = chunk_kda_triton(q, k, v, g, beta, output_final_state=True)
        torch.autograd.grad(o, (q, k, v, g, beta), torch.zeros_like(o))
    return launches


def _sparse_launches(heads: int, kv_heads: int, dk: int, dv: int, topk: int, shared_v: bool = False) -> list[Launch]:
    """Sparse attention forward (every autotune config) and backward (Triton) in bf16; `shared_v`: the values are
    the keys' first dv columns (MLA's latent, absorbed)."""
    import torch

    from moetune.kernels.sparse_attention import sparse_attention

    bf16, device, launches = torch.bfloat16, "meta", []
    for t in (64, 4 * topk):  # the top-k covers all keys, a quarter of them: both dK/dV orders (dkv_order)
        q = torch.empty(1, t, heads, dk, dtype=bf16, device=device, requires_grad=True)
        k = torch.empty(1, t, kv_heads, dk, dtype=bf16, device=device, requires_grad=True)
        v = k[..., :dv] if shared_v else torch.empty(1, t, kv_heads, dv, dtype=bf16, device=device,
                                                     requires_grad=True)
        indices = torch.empty(1, t, topk, dtype=torch.int32, device=device)
        with captured_launches() as found:
            out = sparse_attention(q, k, v, indices, dk ** -0.5, backend="triton")
            torch.autograd.grad(out, (q, k) if shared_v else (q, k, v), torch.empty_like(out))
        launches += found
    return launches


# What the CUDA path launches: MoE at the seed model's widths (7168 hidden, 2048 expert intermediate; gate_up and
# down) over the ranks the API allows, and quantized weights; KDA at 32 heads of 128; sparse attention at the
# seed's top-2048 as the MLA families run it, over the shared latent (GLM-5-Next: 64 heads, 512-wide latent without
# RoPE; DeepSeek-V3.2: 128 heads, 512 + 64 RoPE, and with a LoRA adapter's per-token latent), and with per-head
# keys (192/128, grouped-query layouts).
SM90_CASES = {
    **{f"moe {h}->{o} r{r}": (_moe_launches, (h, o, r)) for h, o in ((7168, 4096), (2048, 7168))
       for r in (8, 16, 64, 128, 256, 512, 1024)},
    **{f"moe {w} 7168->4096 r64": (_moe_launches, (7168, 4096, 64, w)) for w in ("fp8", "int4", "mxfp4")},
    "kda H32 K128 V128": (_kda_launches, (32, 128, 128)),
    "sparse latent H64 512/512 top2048": (_sparse_launches, (64, 1, 512, 512, 2048, True)),
    "sparse latent+rope H128 576/512 top2048": (_sparse_launches, (128, 1, 576, 512, 2048, True)),
    # training with LoRA dropout on kv_b_proj (rank 16): each token's A·dropout(c) rides in the latent
    "sparse latent+rope+lora16 H128 592/528 top2048": (_sparse_launches, (128, 1, 592, 528, 2048, True)),
    "sparse per-head kv H64 192/128 top2048": (_sparse_launches, (64, 64, 192, 128, 2048)),
}


def sm90_report(cases=None) -> list[dict]:
    """Every launch variant of `cases` (default SM90_CASES) built for sm_90, with its resources."""
    cases = SM90_CASES if cases is None else {name: SM90_CASES[name] for name in cases}
    return build_all({name: make(*args) for name, (make, args) in cases.items()})


if __name__ == "__main__":
    import json

    for row in sm90_report():
        print(json.dumps({**row, "over_budget": over_budget(row)}))
