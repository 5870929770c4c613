"""Helpers for checking kernels without a GPU: the error metric the proofs use, and a clean child process for
the sm_90 compile-only builds (kernels.compile_check)."""

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


def compile_in_subprocess(call: str) -> object:
    """Evaluate `call` (an expression returning JSON-able data) in a fresh interpreter without TRITON_INTERPRET:
    Triton's interpreter replaces @triton.jit kernels by objects the compiler cannot take. The bound is wide: the
    suite's sm_90 builds take 41 s alone on 2 cores and passed 300 s under a loaded three-worker run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json, importlib\nprint(json.dumps({call}))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=540,
                          check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])

