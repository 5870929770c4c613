"""Kernel benchmarks: baseline and ours in the same run, ratios printed.

CPU (default): KDA chunked vs naive recurrent (bench/kda.py), sparse attention (the PyTorch path) vs the
dense-mask attention transformers runs (SDPA under the boolean top-k mask), T=4096, top-k=256, forward+backward;
last line RESULT kda_cpu_speedup=<x> sparse_cpu_speedup=<y> ...
GPU (--gpu, the GPU set only, a few minutes): sparse attention (Triton) vs dense causal SDPA at T=8K and 32K with
top-2048, forward and forward+backward, time and TFLOP/s, with one shared kv head (MLA/DSA style) and with one kv
head per query head; MoE-LoRA grouped GEMM (Triton, and torch grouped_mm) vs the per-expert loop; bench/kda.py's
GPU set; last line RESULT with the ratios.

    python bench/kernels.py [--gpu]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import sys
import time

# `python bench/kernels.py` puts bench/ first on sys.path, where this file would shadow the kernels package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]

import torch
import torch.nn.functional as F

from moetune.kernels.moe import moe_lora_grouped
from moetune.kernels.sparse_attention import select_topk, sparse_attention
from moetune.kernels.sparse_attention.reference import topk_mask


def _kda_run(gpu: bool) -> dict:
    """bench/kda.py's own run() (the KDA benchmark lives next to this file); {} when it is not there."""
    path = pathlib.Path(__file__).with_name("kda.py")
    if not path.exists():
        print("kda: bench/kda.py not present")
        return {}
    spec = importlib.util.spec_from_file_location("bench_kda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run(gpu=gpu)


def _time_cpu(fn, reps: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _time_gpu(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=50) / 1e3


def _attention_inputs(batch, seq, heads, kv_heads, dim, topk, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, seq, h, dim, generator=gen, device=device, dtype=dtype).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    # indices from the real indexer on random indexer inputs (4 heads of 64): causal, -1 where the prefix is short
    idx_q = torch.randn(batch, seq, 4, 64, generator=gen, device=device)
    idx_k = torch.randn(batch, seq, 64, generator=gen, device=device)
    idx_w = torch.randn(batch, seq, 4, generator=gen, device=device)
    return q, k, v, select_topk(idx_q, idx_k, idx_w, topk)


def _fwd_bwd(fn, *tensors):
    out = fn()
    grads = torch.autograd.grad(out, tensors, torch.ones_like(out))
    return out, grads


def sparse_cpu(seq=4096, topk=256, heads=4, dim=64) -> dict:
    q, k, v, idx = _attention_inputs(1, seq, heads, heads, dim, topk, torch.float32, "cpu")
    scale = dim ** -0.5

    def dense_mask():  # what transformers' sdpa path does: a [B,1,T,S] boolean mask from the indices
        mask = topk_mask(idx, seq)[:, None]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                             scale=scale)
        return out.transpose(1, 2)

    def sparse():
        return sparse_attention(q, k, v, idx, scale, backend="torch")

    t_dense = _time_cpu(lambda: _fwd_bwd(dense_mask, q, k, v), reps=2)
    t_sparse = _time_cpu(lambda: _fwd_bwd(sparse, q, k, v), reps=2)
    speedup = t_dense / t_sparse
    print(f"sparse attention CPU fwd+bwd T={seq} top-{topk} H={heads} D={dim}: dense-mask SDPA {t_dense * 1e3:.0f} ms, "
          f"sparse {t_sparse * 1e3:.0f} ms, speedup {speedup:.2f}x")
    return {"sparse_cpu_speedup": round(speedup, 2)}


def sparse_gpu(results: dict) -> None:
    """64 query heads (the seed model's count). One shared kv head is the MLA/DSA layout the kernel is built for:
    a query's gathered K/V rows serve all its heads. One kv head per query head (transformers' expanded glm5_next
    layout) gathers 64x the bytes per query, so it runs at 8K only, to keep the set within minutes."""
    for kv_heads, seq in ((1, 8192), (1, 32768), (64, 8192)):
        _sparse_gpu_case(results, seq, kv_heads)
        torch.cuda.empty_cache()  # the case's tensors are gone with its frame; the next case gets the memory back


def _sparse_gpu_case(results: dict, seq: int, kv_heads: int, heads=64, dim=128, topk=2048) -> None:
    q, k, v, idx = _attention_inputs(1, seq, heads, kv_heads, dim, topk, torch.bfloat16, "cuda")
    scale = dim ** -0.5
    valid = (idx >= 0).sum().item()
    flops_sparse = 4 * valid * heads * dim  # QK^T and PV over the selected keys
    flops_dense = 4 * seq * (seq + 1) / 2 * heads * dim  # causal

    # the dense baseline gets its kv heads expanded beforehand so it always runs the flash kernel
    k_dense, v_dense = (x.detach().repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2).requires_grad_()
                        for x in (k, v))

    def dense():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k_dense, v_dense, is_causal=True, scale=scale)

    def sparse():
        return sparse_attention(q, k, v, idx, scale, backend="triton")

    runs = {"fwd": (dense, sparse, 1.0),
            "fwd+bwd": (lambda: _fwd_bwd(dense, q, k_dense, v_dense), lambda: _fwd_bwd(sparse, q, k, v), 3.5)}
    for phase, (run_dense, run_sparse, mult) in runs.items():
        with torch.no_grad() if phase == "fwd" else torch.enable_grad():
            t_dense, t_sparse = _time_gpu(run_dense), _time_gpu(run_sparse)
        ratio = t_dense / t_sparse
        print(f"sparse attention GPU {phase} T={seq} H={heads} Hkv={kv_heads} D={dim} top-{topk}: "
              f"dense SDPA {t_dense * 1e3:.2f} ms ({mult * flops_dense / t_dense / 1e12:.0f} TFLOP/s), "
              f"sparse {t_sparse * 1e3:.2f} ms ({mult * flops_sparse / t_sparse / 1e12:.0f} TFLOP/s), "
              f"speedup {ratio:.2f}x")
        results[f"sparse_gpu_{phase.replace('+', '_')}_speedup_{seq // 1024}k_hkv{kv_heads}"] = round(ratio, 2)


def moe_gpu(results: dict) -> None:
    experts, hidden, inter, rank, tokens = 32, 2048, 1536, 16, 32768
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.multinomial(torch.ones(experts, device="cuda"), tokens, replacement=True, generator=gen)
    counts = torch.bincount(counts, minlength=experts)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * hidden ** -0.5
    a = (torch.randn(experts, hidden, rank, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02).requires_grad_()
    b = (torch.randn(experts, rank, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02).requires_grad_()
    splits = counts.tolist()

    def loop():
        return torch.cat([x_e @ w[e] + 2.0 * (x_e @ a[e]) @ b[e] for e, x_e in enumerate(x.split(splits))])

    def grouped(backend):
        return lambda: _fwd_bwd(lambda: moe_lora_grouped(x, counts, w, a, b, 2.0, backend=backend), x, a, b)

    flops = 2 * tokens * hidden * inter * 3  # fwd+bwd of the frozen GEMM (dX only) plus forward; LoRA is small
    timings = {}
    for name, step in (("loop", lambda: _fwd_bwd(loop, x, a, b)), ("grouped_mm", grouped("torch")),
                       ("triton", grouped("triton"))):
        try:
            timings[name] = _time_gpu(step)
        except RuntimeError as e:  # torch's CUDA grouped_mm has device/alignment limits; the others must run
            if name != "grouped_mm":
                raise
            print(f"MoE-LoRA {name}: not runnable here ({e})")
            continue
        print(f"MoE-LoRA fwd+bwd E={experts} N={tokens} {hidden}->{inter} r={rank}: {name} "
              f"{timings[name] * 1e3:.2f} ms (~{flops / timings[name] / 1e12:.0f} TFLOP/s)")
        if name != "loop":
            results[f"moe_{name}_vs_loop"] = round(timings["loop"] / timings[name], 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="run the GPU set (needs CUDA)")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device")
    results = {} if args.gpu else {"kda_cpu_speedup": "n/a"}  # n/a: bench/kda.py missing
    results.update(_kda_run(gpu=args.gpu))
    if args.gpu:
        sparse_gpu(results)
        moe_gpu(results)
    else:
        results.update(sparse_cpu())
    print("details: " + json.dumps(results))
    scalars = {k: v for k, v in results.items() if isinstance(v, (int, float)) or k == "kda_cpu_speedup"}
    print("RESULT " + " ".join(f"{key}={value}" for key, value in scalars.items()))


if __name__ == "__main__":
    main()
