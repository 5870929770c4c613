"""Every Triton launch variant the CUDA path makes, built for sm_90 (H100/H200) as the launcher specialises its
arguments (kernels.compile_check captures the real host code's launches: every autotune config, the stages and
warps each launch passes), within the budgets: shared memory <= 227 KB, <= 255 registers, no spills beyond the
stated STACK_BUDGET. The suite builds the seed model's shapes at the rank it trains with (16), the largest rank the
API allows (1024: the unfused path), a quantized format, KDA as glm5_next runs it and sparse attention over
deepseek_v32's shared latent, also with a LoRA adapter's latent in its tail (the widest tail: the most live tiles); `python -m moetune.kernels.compile_check` builds all of SM90_CASES
(bench/gpu_check.py runs that)."""

from moetune.kernels.compile_check import SM90_SHARED_BYTES, over_budget
from moetune.kernels.testing import compile_in_subprocess

SUITE_CASES = ["moe 7168->4096 r16", "moe 7168->4096 r1024", "moe int4 7168->4096 r64",
               "kda H32 K128 V128", "sparse latent+rope H128 576/512 top2048",
               "sparse latent+rope+lora16 H128 592/528 top2048"]


def test_every_launch_variant_builds_for_sm90_within_budget():
    rows = compile_in_subprocess(
        f"importlib.import_module('moetune.kernels.compile_check').sm90_report({SUITE_CASES})")
    assert {r["case"] for r in rows} == set(SUITE_CASES)  # every case launched something new
    problems = {f"{r['case']}: {r['launch']}": over_budget(r) for r in rows if over_budget(r)}
    assert not problems, problems
    assert all(0 < r["shared_bytes"] <= SM90_SHARED_BYTES for r in rows)
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"_grouped_lora_mm", "_grouped_outer", "kda_fwd_kernel", "kda_bwd_kernel", "_sparse_attn_fwd",
                       "_sparse_attn_bwd_dq", "_sparse_attn_bwd_dkv", "_sparse_attn_bwd_dkv_query_major"}, kernels
    sparse_forwards = [r for r in rows if r["kernel"] == "_sparse_attn_fwd"]
    assert len(sparse_forwards) == 4  # each autotune config, in both sparse cases
    sparse = [r for r in rows if "sparse" in r["kernel"]]
    assert all("SHARED_V=True" in r["launch"] for r in sparse)
    assert {r["kernel"] for r in sparse if "DKT=80" in r["launch"]} == {r["kernel"] for r in sparse}  # LoRA's tail
