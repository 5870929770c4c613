"""Helpers for checking kernels without a GPU: the error metric the proofs use, and an sm_90 compile-only build."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch


def rmse_ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMSE of the difference over the RMS of the expected tensor (flash-linear-attention's error ratio)."""
    diff = (actual.double() - expected.double()).pow(2).mean().sqrt()
    return (diff / expected.double().pow(2).mean().sqrt().clamp_min(1e-30)).item()


def compile_for_sm90(kernel, arg_types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 2):
    """Compile a @triton.jit kernel to a Hopper (sm_90) cubin on any machine; returns the compiled kernel (its
    metadata.shared is the shared memory it needs). arg_types maps each runtime argument to a Triton type such as
    '*bf16', 'i32' or 'fp32'; every other argument must be given in constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {name: "constexpr" if name in constexprs else arg_types[name] for name in names}
    src = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def compile_in_subprocess(call: str) -> object:
    """Evaluate `call` (an expression returning JSON-able data) in a fresh interpreter without TRITON_INTERPRET:
    Triton's interpreter replaces @triton.jit kernels by objects the compiler cannot take."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json, importlib\nprint(json.dumps({call}))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])

