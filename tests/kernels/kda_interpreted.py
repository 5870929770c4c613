"""Runs the Triton KDA kernels through the interpreter and prints, as JSON, each case's RMSE ratios against the
oracle. Run in its own process with TRITON_INTERPRET=1: triton reads the switch when it is first imported."""

from __future__ import annotations

import json
import os

import torch

from kernels.kda import naive_recurrent_kda
from kernels.kda.triton_kda import chunk_kda_triton
from tests.kernels.kda_cases import (
    NAMES,
    as_fp32,
    make_inputs,
    rmse_ratio,
    run_with_grads,
)


def compare(ours, ref):
    finite = all(bool(torch.isfinite(x).all()) for x in ours.values())
    return {"finite": finite, **{key: rmse_ratio(ours[key], ref[key]) for key in ours}}


def fp32_case():
    inputs = make_inputs(2, 45, 2, 16, 32, gate_scale=4.0)  # 45 tokens: a full and a partial 32-token chunk
    return compare(run_with_grads(chunk_kda_triton, inputs), run_with_grads(naive_recurrent_kda, inputs))


def low_precision_case(dtype):
    inputs = make_inputs(1, 40, 2, 16, 16, dtype=dtype)
    ours = run_with_grads(chunk_kda_triton, inputs)
    result = compare(ours, run_with_grads(naive_recurrent_kda, as_fp32(inputs)))
    result["dtypes"] = sorted({str(ours[key].dtype) for key in ("o", "dq", "dk", "dv", "dg", "dbeta")})
    return result


def packed_case():
    cu_seqlens = torch.tensor([0, 0, 33, 33, 50])  # zero-length segments first and in the middle
    inputs = make_inputs(1, 50, 1, 16, 16, n_states=4)
    ours = run_with_grads(chunk_kda_triton, inputs, cu_seqlens)
    result = compare(ours, run_with_grads(naive_recurrent_kda, inputs, cu_seqlens))
    result["empty_passes_state"] = bool(torch.equal(ours["final"][2], inputs["h0"][2].detach()))
    return result


def stateless_case():
    inputs = make_inputs(1, 20, 1, 16, 16)
    args = [inputs[n] for n in NAMES[:5]]
    o, final = chunk_kda_triton(*args)
    ref, _ = naive_recurrent_kda(*args)
    o.sum().backward()
    with torch.no_grad():  # inference: no per-chunk states kept
        o_inference, _ = chunk_kda_triton(*args)
    return {"final_is_none": final is None, "o": rmse_ratio(o, ref), "o_inference": rmse_ratio(o_inference, ref),
            "all_grads": all(inputs[n].grad is not None for n in NAMES[:5])}


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    cases = {"fp32": fp32_case, "fp16": lambda: low_precision_case(torch.float16),
             "bf16": lambda: low_precision_case(torch.bfloat16), "packed": packed_case, "stateless": stateless_case}
    print(json.dumps({name: case() for name, case in cases.items()}))


if __name__ == "__main__":
    main()
