"""The Triton KDA kernels without a GPU: run through TRITON_INTERPRET against the oracle (forward and every
gradient), and compiled for sm_90 to catch shape, dtype and resource errors that the interpreter lets through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.kda import triton_kda
from tests.kernels.kda_cases import BF16_TOL, FP32_TOL

REPO = Path(__file__).resolve().parents[2]
GRADIENTS = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.fixture(scope="module")
def interpreted():
    """All interpreter cases in one child process: triton picks interpreter or compiler when first imported, and
    this process may already hold the compiled flavour."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.kda_interpreted"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_interpreted_matches_oracle_fp32(interpreted):
    case = interpreted["fp32"]
    assert case["finite"] and max(case[key] for key in GRADIENTS) <= FP32_TOL, case


@pytest.mark.parametrize("dtype,tol", [("fp16", FP32_TOL), ("bf16", BF16_TOL)])
def test_interpreted_low_precision_inputs(interpreted, dtype, tol):
    """fp16/bf16 in and out (tiles are fp32 inside, so bf16 works under the interpreter too); the oracle runs on
    the same rounded inputs in fp32, so what differs is the rounding of the results."""
    case = interpreted[dtype]
    assert case["dtypes"] == [f"torch.{'float16' if dtype == 'fp16' else 'bfloat16'}"]
    assert case["finite"] and max(case[key] for key in GRADIENTS) <= tol, case


def test_interpreted_packed_with_empty_segments(interpreted):
    case = interpreted["packed"]
    assert case["finite"] and max(case[key] for key in GRADIENTS) <= FP32_TOL, case
    assert case["empty_passes_state"]


def test_interpreted_without_states(interpreted):
    case = interpreted["stateless"]
    assert case["final_is_none"] and case["all_grads"] and case["o"] <= FP32_TOL and case["o_inference"] <= FP32_TOL


def compile_for_sm90(kernel, constants, num_warps):
    """Compile a kernel for an H100/H200 from the CPU: bf16 activations, fp32 states."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    activations = {"q", "k", "v", "g", "beta", "o", "do"}
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name == "scale":
            signature[name] = "fp32"
        elif name in ("cu_seqlens", "chunk_offsets"):
            signature[name] = "*i32" if name == "cu_seqlens" else "*i64"
        else:
            signature[name] = "*bf16" if name in activations else "*fp32"
    source = ASTSource(kernel, signature, constexprs=constants)
    return triton_kda.triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


@pytest.mark.parametrize("kernel,constants,num_warps", [
    (triton_kda.kda_fwd_kernel, {"H": 4, "K": 128, "V": 128, "BT": triton_kda.CHUNK, "BK": 128, "BV": 64,
                                 "HAS_H0": True, "STORE_HT": True, "STORE_STATES": True}, 4),
    (triton_kda.kda_bwd_kernel, {"H": 4, "K": 128, "V": 128, "BT": triton_kda.CHUNK, "BK": 128, "BV": 128,
                                 "HAS_DHT": True}, 8),
], ids=["forward", "backward"])
def test_compiles_for_sm90(kernel, constants, num_warps):
    compiled = compile_for_sm90(kernel, constants, num_warps)
    assert "cubin" in compiled.asm and compiled.metadata.shared <= 227 * 1024  # H100/H200 shared memory per block
