"""fla's KDA and Gated DeltaNet kernels as moetune's CUDA path calls them (kernels.kda), built for sm_90 without a
GPU: the launches fla's host code makes on the dtypes the models hand it (bf16 q, k, v and β, fp32 gates), each
lowered to Triton IR for sm_90, where operand dtypes are checked. fla is never importable in this suite's process
(transformers dispatches to it whenever it is): `make install` downloads fla-core's wheel into the virtualenv's
wheels/ folder without installing it, and a child process imports it from there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _fla_wheel() -> Path:
    """fla-core's wheel at the version the `[cuda]` extra pins."""
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    version = next(pin.split("==")[1] for pin in pins if pin.startswith("fla-core=="))
    wheel = Path(sys.prefix) / "wheels" / f"fla_core-{version}-py3-none-any.whl"
    if not wheel.is_file():
        pytest.fail(f"{wheel} is missing: `make install` downloads it (pip download --no-deps fla-core=={version})")
    return wheel


@pytest.fixture(scope="module")
def fla_path(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fla")
    with zipfile.ZipFile(_fla_wheel()) as wheel:
        wheel.extractall(folder)
    return folder


def _in_fla_child(fla_path: Path, ops: list[str], interpreted: bool = False) -> dict:
    """tests.support.kda_cases.fla_launch_failures of each op, in a child where fla is importable; `interpreted`:
    kda_cases.fla_decode_errors instead, under the Triton interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter replaces kernels
    env["PYTHONPATH"] = os.pathsep.join([str(fla_path), str(REPO)])
    env.pop("MOETUNE_KDA_KERNEL", None)  # the default: fla, where it is importable
    if interpreted:
        env["TRITON_INTERPRET"] = "1"
    call = "fla_decode_errors()" if interpreted else "{op: fla_launch_failures(op) for op in sys.argv[1:]}"
    code = (f"import json, sys\nfrom tests.support.kda_cases import fla_decode_errors, fla_launch_failures\n"
            f"print(json.dumps({call}))")
    done = subprocess.run([sys.executable, "-c", code, *ops], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fla_launches_build_for_sm90_on_the_models_dtypes(fla_path):
    """kimi_linear's and glm5_next's KDA (the latter on fla's bounded-gate path) and qwen3_next / qwen3_5_moe's
    Gated DeltaNet: every launch builds. q and k normalised in fp32 before fla, against bf16 v, failed in
    recompute_w_u_fwd_kda_kernel, chunk_kda_bwd_kernel_dAv and chunk_kda_bwd_kernel_wy_dqkg_fused."""
    results = _in_fla_child(fla_path, ["kda", "kda_bounded", "gated_delta", "kda_decode"])
    assert {op: r["failures"] for op, r in results.items()} == {"kda": {}, "kda_bounded": {}, "gated_delta": {},
                                                                "kda_decode": {}}
    assert results["kda_decode"]["kernels"] == ["fused_recurrent_kda_fwd_kernel"]  # K3's decode step: one launch
    # fla's own kernels ran, its normalisation included, and the bound chose its sub-chunk path
    assert {"recompute_w_u_fwd_kda_kernel", "chunk_kda_bwd_kernel_dAv", "l2norm_fwd_kernel"} <= set(
        results["kda"]["kernels"])
    assert "chunk_kda_fwd_kernel_intra_sub_chunk" in set(results["kda_bounded"]["kernels"]) - set(
        results["kda"]["kernels"])
    assert {"recompute_w_u_fwd_kernel", "chunk_local_cumsum_scalar_kernel"} <= set(results["gated_delta"]["kernels"])


def test_fla_decode_step_equals_the_cpu_step(fla_path):
    """Kimi K3's decode step on CUDA is fla's fused_recurrent_kda (kernels.kda.recurrent_kda): run by the Triton
    interpreter on CPU tensors, it gives the CPU step's outputs and final states on the same rows (one token a row,
    and three), so moetune hands it the layout it reads (q, k, g [B, T, H, K], β [B, T, H], states [B, H, K, V])."""
    errors = _in_fla_child(fla_path, [], interpreted=True)
    assert errors.keys() == {"3x1", "2x3"}
    assert all(o < 1e-5 and final < 1e-5 for o, final in errors.values()), errors


# In the child: two KDA layers of one packed micro-batch through moetune's CUDA kernel (fla), launches captured;
# prints how often fla built its chunk bookkeeping from the offsets (_segmented_arange) after each layer.
_TWO_PACKED_LAYERS = """
import json, torch
import fla.ops.utils.index as index
from moetune.kernels.compile_check import captured_launches
from moetune.kernels.kda import kda_kernel, packed_offsets
built, make = [], index._segmented_arange
index._segmented_arange = lambda counts: built.append(1) or make(counts)
offsets = packed_offsets(torch.tensor([0, 40, 128], dtype=torch.int32), "cpu")  # as Batch.to makes them
after = []
with captured_launches():
    for layer in range(2):
        q, k = (torch.zeros(1, 128, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        v = torch.zeros(1, 128, 2, 64, dtype=torch.bfloat16, requires_grad=True)
        g, beta = torch.zeros(1, 128, 2, 64, requires_grad=True), torch.zeros(1, 128, 2, dtype=torch.bfloat16)
        o, _ = kda_kernel("cuda")(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
        torch.autograd.grad(o, (q, k, v, g), torch.zeros_like(o))
        after.append(len(built))
print(json.dumps(after))
"""


def test_fla_builds_the_chunk_bookkeeping_of_a_packed_micro_batch_once(fla_path):
    """moetune's fla call takes the micro-batch's int64 offsets and their host copy (`cu_seqlens_cpu`): fla builds
    its chunk indices in the first KDA layer and finds them in its identity-keyed caches in the next (int32
    offsets converted per call missed them: a host sync per layer on CUDA)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOETUNE_KDA_KERNEL")}
    env["PYTHONPATH"] = os.pathsep.join([str(fla_path), str(REPO)])
    done = subprocess.run([sys.executable, "-c", _TWO_PACKED_LAYERS], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert first > 0 and second == first
