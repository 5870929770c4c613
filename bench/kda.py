"""KDA benchmark: baseline and ours in the same run, ratios printed.

CPU: the chunked PyTorch path vs the naive recurrent oracle, forward + backward at T=2048 (goal >= 10x).
GPU (--gpu): the Triton kernels, forward and forward + backward, at T = 8K and 32K against dense causal
`scaled_dot_product_attention` of the same head count and head size; time and TFLOP/s (see `kda_flops`).

`run(gpu)` returns the numbers (bench/kernels.py imports it); `python bench/kda.py [--gpu]` prints them and a
RESULT line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# `python bench/kda.py` puts bench/ first on sys.path, where bench/kernels.py would shadow the kernels package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]

import torch
import torch.nn.functional as F

from moetune.kernels.kda import chunk_kda, chunk_kda_torch, naive_recurrent_kda

CPU_SHAPE = {"batch": 1, "seq_len": 2048, "heads": 4, "dk": 128, "dv": 128}
GPU_HEADS, GPU_HEAD_DIM, GPU_LENGTHS = 16, 128, (8192, 32768)


def make_inputs(batch, seq_len, heads, dk, dv, device="cpu", dtype=torch.float32):
    gen = torch.Generator(device).manual_seed(0)
    q = F.normalize(torch.randn(batch, seq_len, heads, dk, device=device, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(batch, seq_len, heads, dk, device=device, generator=gen), dim=-1).to(dtype)
    v = torch.randn(batch, seq_len, heads, dv, device=device, generator=gen).to(dtype)
    g = -torch.rand(batch, seq_len, heads, dk, device=device, generator=gen) * 0.5  # gates stay fp32, as in models
    beta = torch.rand(batch, seq_len, heads, device=device, generator=gen).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def fwd_bwd(fn, inputs):
    for x in inputs:
        x.grad = None
    o, _ = fn(*inputs)
    o.float().square().mean().backward()


def _seconds(step):
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def run_cpu(rounds=3) -> dict:
    """Best of `rounds` for each, the two alternating: on a shared machine a burst of load then hits both."""
    inputs = make_inputs(**CPU_SHAPE)
    fwd_bwd(chunk_kda_torch, inputs)  # warm-up
    chunked = naive = float("inf")
    for _ in range(rounds):
        chunked = min(chunked, _seconds(lambda: fwd_bwd(chunk_kda_torch, inputs)))
        naive = min(naive, _seconds(lambda: fwd_bwd(naive_recurrent_kda, inputs)))
    return {"kda_cpu_shape": CPU_SHAPE, "kda_cpu_naive_s": round(naive, 3), "kda_cpu_chunked_s": round(chunked, 3),
            "kda_cpu_speedup": round(naive / chunked, 1)}


def kda_flops(seq_len, heads, dk, dv, chunk):
    """Matmul FLOPs of the chunked forward per the formulas in kernels/kda/triton_kda.py: per token, the pairwise
    A_kk and A_qk rows (2·C·K each), W and U (2·C·(K+V)), W·S, Q·S and the state update (2·K·V each) and
    A_qk·V' (2·C·V). The backward is counted as 2x the forward, as for attention."""
    per_token = 2 * (2 * chunk * dk + chunk * (dk + dv) + 3 * dk * dv + chunk * dv)
    return seq_len * heads * per_token


def sdpa_flops(seq_len, heads, head_dim):
    """Causal attention: QKᵀ and PV over half of the T×T matrix."""
    return 4 * seq_len * seq_len * heads * head_dim // 2


def cuda_seconds(step, repeats=5):
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def check_on_gpu() -> float:
    """Worst RMSE ratio of the compiled kernels against the oracle (fp32, a partial chunk, fwd and grads)."""
    inputs = make_inputs(1, 200, 2, 64, 64, device="cuda")
    results = []
    for fn in (chunk_kda, naive_recurrent_kda):
        fwd_bwd(fn, inputs)
        o, _ = fn(*inputs)
        results.append([o.detach(), *(x.grad.clone() for x in inputs)])
    return max(((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item() for a, b in zip(*results))


def run_gpu() -> dict:
    out = {"kda_gpu_device": torch.cuda.get_device_name(), "kda_gpu_check_rmse_ratio": check_on_gpu()}
    for seq_len in GPU_LENGTHS:
        out.update(_gpu_case(seq_len))
    return out


def _gpu_case(seq_len) -> dict:
    from moetune.kernels.kda.triton_kda import CHUNK

    tag = f"{seq_len // 1024}k"
    inputs = make_inputs(1, seq_len, GPU_HEADS, GPU_HEAD_DIM, GPU_HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    qkv = [torch.randn(1, GPU_HEADS, seq_len, GPU_HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3)]

    def sdpa_fwd():
        return F.scaled_dot_product_attention(*qkv, is_causal=True)

    def sdpa_fwd_bwd():
        sdpa_fwd().float().square().mean().backward()

    with torch.no_grad():
        kda_f = cuda_seconds(lambda: chunk_kda(*inputs))
        sdpa_f = cuda_seconds(sdpa_fwd)
    kda_fb = cuda_seconds(lambda: fwd_bwd(chunk_kda, inputs))
    sdpa_fb = cuda_seconds(sdpa_fwd_bwd)
    flops_kda = kda_flops(seq_len, GPU_HEADS, GPU_HEAD_DIM, GPU_HEAD_DIM, CHUNK)
    flops_sdpa = sdpa_flops(seq_len, GPU_HEADS, GPU_HEAD_DIM)
    return {
        f"kda_fwd_ms_{tag}": round(kda_f * 1e3, 3), f"sdpa_fwd_ms_{tag}": round(sdpa_f * 1e3, 3),
        f"kda_fwd_bwd_ms_{tag}": round(kda_fb * 1e3, 3), f"sdpa_fwd_bwd_ms_{tag}": round(sdpa_fb * 1e3, 3),
        f"kda_fwd_tflops_{tag}": round(flops_kda / kda_f / 1e12, 2),
        f"sdpa_fwd_tflops_{tag}": round(flops_sdpa / sdpa_f / 1e12, 2),
        f"kda_fwd_bwd_tflops_{tag}": round(3 * flops_kda / kda_fb / 1e12, 2),
        f"sdpa_fwd_bwd_tflops_{tag}": round(3.5 * flops_sdpa / sdpa_fb / 1e12, 2),
        f"kda_vs_sdpa_fwd_{tag}": round(sdpa_f / kda_f, 2), f"kda_vs_sdpa_fwd_bwd_{tag}": round(sdpa_fb / kda_fb, 2),
    }


def run(gpu: bool) -> dict:
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device")
    return run_gpu() if gpu else run_cpu()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="Triton kernels vs SDPA on the CUDA device")
    result = run(parser.parse_args().gpu)
    print(json.dumps(result, indent=1))
    keys = [k for k in result if k == "kda_cpu_speedup" or k.startswith("kda_vs_sdpa")]
    print("RESULT " + " ".join(f"{k}={result[k]}" for k in keys))


if __name__ == "__main__":
    main()
