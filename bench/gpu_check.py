"""GPU readiness check for one GPU, in under 8 minutes: correctness first, throughput last.

Stages, each with a time budget (PLAN, printed first as the `plan` line: 8 minutes in all), each written as one
JSON line to stdout and to $OUT/gpu_check.jsonl (when OUT is set) as it finishes:
  env          torch, Triton, the device, which optional packages are here; the device's measured bf16 matmul
               TFLOP/s and copy GB/s (the peaks the benchmarks are reported against)
  correctness  every kernel against its reference on the device in fp32 and bf16 (tolerances asserted): MoE
               grouped LoRA GEMM (dense at a fused and an unfused rank, FP8/INT4/MXFP4 weights), KDA and (fla)
               Gated DeltaNet on the dtypes the models hand them (q, k, v, β in the run's dtype, fp32 gates), sparse
               attention, the fused linear cross-entropy (when liger-kernel is here); and the bytes fla's KDA keeps
               for the backward against the planner's count for it (within 10 %)
  syncs        host syncs per MoE layer (the expert-parallel experts module at EP=1), per KDA layer and per sparse
               attention forward + backward over a latent, counted
               with torch.cuda.set_sync_debug_mode("warn")
  job_step     one process group of one rank (NCCL), the tiny model of a family through moetune's own engine
               (DeepSpeed ZeRO-2 and ZeRO-3), custom kernels on vs off: the first losses must agree
  builder_step tiny Kimi K3 (MXFP4 experts, expert LoRA) through build_model("train") under ZeRO-3 with the load
               partitioner, loss head and MoE metrics hooks: one step, nothing left on the host
  images_zero3 an image model under ZeRO-3 whose last rank's micro-batch has no image (the blank-image path; two
               ranks where two GPUs are)
  ep2_export   EP=2 adapter export bit for bit against the ranks' own expert factors (two GPUs; skipped on one)
  context_parallel  KDA over two CP ranks (a packed row whose middle sequence crosses the cut, K3's head size,
               32K tokens): moetune's state passing over the device's chunk_kda and fla's own `cp_context`, each
               against the unsplit kernel (output and every input's gradient) and timed (two GPUs; skipped on one)
  sparse_dkv   the sparse attention backward's two dK/dV passes (key-major over the inverted selection,
               query-major with fp32 atomics) over glm5_next's latent at 8K/32K, latest and random top-k keys:
               the time of each, that they agree, and whether triton_impl.dkv_order's choice was the faster
  bench        KDA (moetune's Triton vs fla's chunk_kda when fla is here, as kernels.kda calls each), sparse
               attention over the shared MLA latent and over per-head keys, for the latest and for random top-k
               keys, forward and backward, vs dense causal SDPA at 8K/32K, MoE Triton vs torch grouped_mm; time,
               TFLOP/s and GB/s against the env peaks
The last line is `RESULT key=value ...`. A failed check is recorded and the later stages still run; the exit
status is 1 when any check failed. On a device a stage that outruns its budget fails, and the benchmarks skip
their remaining shapes once it is spent. The sm_90 builds of every launch variant (registers, spills, shared
memory) are no stage: they need no device, take ~200 s, and a Triton cache built here would not serve the
device's Triton version; `python -m moetune.kernels.compile_check` runs them anywhere (the suite runs its share).

Needs torch and Triton with a CUDA device; everything else it imports is bench/gpu_check_requirements.txt (the
whole closure, pinned, so a bare GPU image needs nothing more). moetune is imported from this checkout (installed
or not). The wheels (about 50 MiB, deepspeed as its source), fetched here, in the repository root:
    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --no-binary=deepspeed --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl -r bench/gpu_check_requirements.txt
and on the GPU host, before the check (DS_BUILD_OPS=0: deepspeed builds no extension):
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
        .whl/* && export PYTHONPATH=/tmp/site
    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py

--dry-run runs every stage's code on this CPU (Triton through its interpreter, gloo instead of NCCL, tiny
shapes, no budgets) so that the script is known to run as it is; tests/kernels/test_gpu_check_dry_run.py runs it
in a virtualenv holding torch, Triton and the requirements file alone.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback
import types
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
# `python bench/gpu_check.py` puts bench/ first on sys.path, where bench/kernels.py would shadow the kernels package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != str(ROOT / "bench")]


def _moetune_from_checkout() -> None:
    """moetune as installed, else this checkout's folders as its subpackages (what setup.py maps); bench.support
    from this checkout."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    if importlib.util.find_spec("moetune") is None:
        package = types.ModuleType("moetune")
        package.__path__ = [str(ROOT)]
        sys.modules["moetune"] = package


# seconds per stage on one H200 (estimates until a device run shows its own): 8 minutes in all
PLAN = {"env": 20, "correctness": 140, "syncs": 30, "job_step": 60, "builder_step": 35, "images_zero3": 25,
        "ep2_export": 20, "context_parallel": 30, "sparse_dkv": 50, "bench": 70}


class Report:
    """Stage results, printed and appended to $OUT/gpu_check.jsonl as each stage finishes."""

    def __init__(self):
        out = os.environ.get("OUT")
        self.path = pathlib.Path(out) / "gpu_check.jsonl" if out else None
        self.failures, self.summary = [], {}

    def write(self, stage: str, data: dict) -> None:
        line = json.dumps({"stage": stage, **data}, default=str)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def plan(self) -> None:
        self.write("plan", {"budget_seconds": PLAN, "total_seconds": sum(PLAN.values())})

    def run(self, stage: str, fn, s, *args) -> dict:
        """fn(s, *args) within the stage's budget (a device run that outruns it fails the stage)."""
        started, cpu = time.perf_counter(), time.process_time()
        s.deadline = float("inf") if s.dry else started + PLAN[stage]
        try:
            data = fn(s, *args)
        except Exception as e:  # the next stages still run: one report shows everything that is wrong
            self.failures.append(stage)
            data = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        seconds = time.perf_counter() - started
        if seconds > PLAN[stage] and not s.dry:
            self.failures.append(stage)
            data = {**data, "over_budget": True}
        self.write(stage, {**data, "seconds": round(seconds, 1), "budget_seconds": PLAN[stage],
                           "cpu_seconds": round(time.process_time() - cpu, 1)})
        return data


class Setting:
    """Shapes and devices of a run: the real check on CUDA, or the dry run's tiny ones on CPU."""

    def __init__(self, dry: bool):
        import torch

        self.dry = dry
        self.device = torch.device("cpu" if dry else "cuda")
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.deadline = float("inf")  # the running stage's (Report.run)

    def spent(self) -> dict | None:
        """A note to record instead of a measurement once the running stage's budget is spent, else None."""
        return {"skipped": "the stage's time budget is spent"} if time.perf_counter() > self.deadline else None

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def seconds(self, fn, reps: int = 10) -> float:
        """Median wall time of fn, after a warm-up run (CUDA: synchronised around each run); the dry run times one
        run (its numbers mean nothing, the code path is what it checks)."""
        if not self.dry:
            fn()
        times = []
        for _ in range(1 if self.dry else reps):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def stage_env(s: Setting) -> dict:
    import torch
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "dry_run": s.dry,
            "packages": {n: _installed(n) for n in ("deepspeed", "pydantic", "transformers", "peft", "fla",
                                                     "liger_kernel")}}
    n = 256 if s.dry else 8192
    a = torch.randn(n, n, device=s.device, dtype=torch.bfloat16)
    t = s.seconds(lambda: a @ a)
    big = torch.empty(2**20 if s.dry else 2**31, dtype=torch.uint8, device=s.device)  # 2 GiB on the GPU
    copy = s.seconds(lambda: big.clone())
    info.update(peak_bf16_tflops=float(f"{2 * n**3 / t / 1e12:.4g}"),
                peak_copy_gbs=float(f"{2 * big.numel() / copy / 1e9:.4g}"))
    if s.device.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
    return info


def _rmse(got, want) -> float:
    from moetune.kernels.testing import rmse_ratio

    return rmse_ratio(got.float(), want.float())


def _leaves(device, dtype, *shapes, scale=1.0, grad=True):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    return [(torch.randn(*sh, generator=gen, device=device) * scale).to(dtype).requires_grad_(grad) for sh in shapes]


def _grads(out, inputs, seed=1):
    import torch

    cot = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(seed), device=out.device)
    return torch.autograd.grad(out, inputs, cot.to(out.dtype))


def _check_moe(s: Setting, dtype, rank: int, weight: str) -> float:
    import torch

    from moetune.kernels.moe import moe_lora_grouped
    from moetune.kernels.moe.reference import moe_lora_reference
    from moetune.kernels.quant import quantize_fp8_block, quantize_int4, quantize_mxfp4

    d_in, d_out = (64, 96) if s.dry else (1024, 1536)
    counts = torch.tensor([5, 0, 20, 3] if s.dry else [300, 0, 1200, 548], device=s.device)
    x, a, b = _leaves(s.device, dtype, (int(counts.sum()), d_in), (4, d_in, rank), (4, rank, d_out), scale=0.3)
    dense = torch.randn(4, d_out, d_in, device=s.device) * d_in**-0.5
    if weight == "dense":
        w, w_ref = dense.to(dtype).transpose(1, 2), dense.to(dtype).float().transpose(1, 2)
    else:
        quantize = {"fp8": quantize_fp8_block, "int4": quantize_int4, "mxfp4": quantize_mxfp4}[weight]
        w = quantize(dense)
        w_ref = w.dequantize(dtype=dtype).float().transpose(1, 2)
    out = moe_lora_grouped(x, counts, w, a, b, 2.0, backend="triton")
    ref = moe_lora_reference(x.float(), counts, w_ref, a.float(), b.float(), 2.0)
    pairs = [(out, ref), *zip(_grads(out, (x, a, b)), _grads(ref, (x, a, b)))]
    return max(_rmse(g, w_) for g, w_ in pairs)


def _cuda_kda(name: str, op: str = "kda"):
    """The CUDA implementation MOETUNE_KDA_KERNEL=name gives `op` ("kda" or "gated_delta"), with the contract of
    kernels.kda's chunk_kda / chunk_gated_delta_rule, which the model layers call (q and k normalised inside)."""
    import os
    from unittest import mock

    from moetune.kernels.kda import KERNEL_SETTING, cuda_kda_kernel, gated_delta_kernel

    with mock.patch.dict(os.environ, {KERNEL_SETTING: name}):
        return gated_delta_kernel("cuda") if op == "gated_delta" else cuda_kda_kernel()


def _check_kda(s: Setting, dtype, impl: str = "moetune", op: str = "kda") -> float:
    """A CUDA KDA (or Gated DeltaNet: one decay per head, two value heads per query/key head) implementation on the
    dtypes the model layers hand it: q, k (unnormalised), v and β in `dtype`, the gates in fp32; against the
    recurrent oracle on the same values in fp32."""
    import torch

    from moetune.kernels.kda import l2norm, naive_recurrent_kda

    t, h, d = (20, 1, 16) if s.dry else (300, 4, 64)
    hv = 2 * h if op == "gated_delta" else h
    gate = (1, t, hv) if op == "gated_delta" else (1, t, h, d)
    q, k, v, g, beta = _leaves(s.device, torch.float32, (1, t, h, d), (1, t, h, d), (1, t, hv, d), gate, (1, t, hv),
                               grad=False)
    g, beta = -g.abs() * 0.5, beta.sigmoid()
    inputs = [x.to(dtype if i != 3 else torch.float32).requires_grad_() for i, x in enumerate((q, k, v, g, beta))]
    ours, _ = _cuda_kda(impl, op)(*inputs, use_qk_l2norm_in_kernel=True)
    fp32 = [x.detach().float().requires_grad_() for x in inputs]
    q_ref, k_ref = (l2norm(x).repeat_interleave(hv // h, dim=2) for x in fp32[:2])
    g_ref = fp32[3][..., None].expand(*fp32[3].shape, d) if op == "gated_delta" else fp32[3]
    ref, _ = naive_recurrent_kda(q_ref, k_ref, fp32[2], g_ref, fp32[4])
    pairs = [(ours, ref), *zip(_grads(ours, inputs), _grads(ref, fp32))]
    return max(_rmse(a, b) for a, b in pairs)


def _check_kda_decode(s: Setting, dtype) -> float:
    """Generation's KDA step as kernels.kda.recurrent_kda runs it on CUDA (fla's fused_recurrent_kda where fla is
    here): rows of one token on fp32 states, q, k (unnormalised) and v in `dtype`, gates and β in fp32 (Kimi K3's
    decode); against the PyTorch step on the same values in fp32, outputs and final states."""
    import torch

    from moetune.kernels.kda import l2norm, recurrent_kda_kernel, recurrent_kda_torch

    rows, h, d = (3, 1, 16) if s.dry else (64, 96, 128)
    q, k, v, g, beta = _leaves(s.device, torch.float32, *[(rows, 1, h, d)] * 4, (rows, 1, h), grad=False)
    g, beta = -g.abs() * 0.5, beta.sigmoid()
    state = _leaves(s.device, torch.float32, (rows, h, d, d), grad=False)[0]
    low = [x.to(dtype) for x in (q, k, v)]
    ours = recurrent_kda_kernel(s.device)(*low, g, beta, initial_state=state, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
    q32, k32, v32 = (x.float() for x in low)
    ref = recurrent_kda_torch(l2norm(q32), l2norm(k32), v32, g, beta, initial_state=state, output_final_state=True)
    return max(_rmse(a, b) for a, b in zip(ours, ref))


def _check_sparse(s: Setting, dtype) -> float:
    """Over a shared latent as the MLA families run it (one kv head; values = its first columns; a RoPE tail)."""
    from moetune.kernels.sparse_attention import select_topk, sparse_attention
    from moetune.kernels.sparse_attention.reference import sparse_attention_reference

    t, h, dk, dv, topk = (20, 2, 24, 16, 8) if s.dry else (512, 32, 576, 512, 128)
    q, kv = _leaves(s.device, dtype, (1, t, h, dk), (1, t, 1, dk), scale=dk**-0.25)
    qi, ki, wi = _leaves(s.device, dtype, (1, t, 2, 16), (1, t, 16), (1, t, 2), grad=False)
    indices = select_topk(qi.float(), ki.float(), wi.float(), topk)
    out = sparse_attention(q, kv, kv[..., :dv], indices, dk**-0.5, backend="triton")
    fp32 = [x.detach().float().requires_grad_() for x in (q, kv)]
    ref = sparse_attention_reference(fp32[0], fp32[1], fp32[1][..., :dv], indices, dk**-0.5)
    pairs = [(out, ref), *zip(_grads(out, (q, kv)), _grads(ref, fp32))]
    return max(_rmse(a, b) for a, b in pairs)


def _check_loss(s: Setting, dtype) -> float:
    import torch

    from moetune.kernels.loss.chunked import chunked_linear_cross_entropy_sum
    from moetune.kernels.loss.dispatch import _liger_sum

    n, hidden, vocab = (20, 16, 64) if s.dry else (4096, 1024, 32000)
    h, w = _leaves(s.device, dtype, (n, hidden), (vocab, hidden), scale=hidden**-0.25)
    y = torch.randint(0, vocab, (n,), device=s.device)
    ours = _liger_sum(h, w, y)
    ref = chunked_linear_cross_entropy_sum(h.float(), w.float(), y)
    (g_ours,), (g_ref,) = torch.autograd.grad(ours, (h,)), torch.autograd.grad(ref, (h,))
    return max(_rmse(ours, ref), _rmse(g_ours, g_ref))


# error ratio allowed per dtype: fp32 tl.dot runs as TF32 on a GPU (exact fp32 in the interpreter)
TOLERANCE = {"float32": 5e-3, "bfloat16": 2e-2}


# the dry run's subset: each check function once (the unfused rank, a quantized format and bf16 included)
DRY_CHECKS = ("moe_dense_r16_float32", "moe_dense_unfused_rank_float32", "moe_int4_r16_bfloat16", "kda_float32",
              "sparse_attention_bfloat16", "linear_cross_entropy_float32")


def _kda_saved_bytes(s: Setting) -> dict:
    """What fla's chunk_kda keeps for the backward against what the planner counts for it (planner.device_ops'
    stand-in on the meta device), on a 4K-token row of K3's KDA shape."""
    import torch

    import moetune.kernels.kda as kda
    from moetune.workers.planner.device_ops import kernels_as_run_on
    from moetune.workers.planner.saved import SavedBytes

    def saved(device, run) -> int:
        shapes = [(1, 4096, 16, 128)] * 4 + [(1, 4096, 16)]
        q, k, v, g, beta = (torch.empty(shape, device=device, dtype=torch.float32 if i == 3 else torch.bfloat16)
                            for i, shape in enumerate(shapes))
        if device != "meta":  # values in the ranges the layers give: gates below 0, β in (0, 1)
            q, k, v, g, beta = (x.normal_() for x in (q, k, v, g, beta))
            g, beta = -g.abs() * 0.1, beta.sigmoid()
        inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
        counter = SavedBytes(torch.nn.Module())
        with counter.counting():
            run(*inputs)
        return counter.total

    with kernels_as_run_on("cuda"):
        planned = saved("meta", lambda *x: kda.chunk_kda(*x, use_qk_l2norm_in_kernel=True))
    if not (_installed("fla") and s.device.type == "cuda"):
        return {"planned": planned, "skipped": "fla's kernel runs on CUDA only, with fla installed"}
    kept = saved(s.device, lambda *x: _cuda_kda("fla")(*x, use_qk_l2norm_in_kernel=True))
    if not 0.9 <= planned / kept <= 1.1:
        raise AssertionError(f"the planner counts {planned} bytes for fla's KDA, which keeps {kept}")
    return {"planned": planned, "fla": kept, "ratio": round(planned / kept, 3)}


def stage_correctness(s: Setting) -> dict:
    import torch

    checks = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[1]
        checks[f"moe_dense_r16_{name}"] = lambda d=dtype: _check_moe(s, d, 16, "dense")
        checks[f"moe_dense_unfused_rank_{name}"] = lambda d=dtype: _check_moe(s, d, 160 if s.dry else 1024, "dense")
        checks[f"kda_{name}"] = lambda d=dtype: _check_kda(s, d)
        checks[f"sparse_attention_{name}"] = lambda d=dtype: _check_sparse(s, d)
        for weight in ("fp8", "int4", "mxfp4"):
            checks[f"moe_{weight}_r16_{name}"] = lambda d=dtype, w=weight: _check_moe(s, d, 16, w)
        if _installed("liger_kernel"):
            checks[f"linear_cross_entropy_{name}"] = lambda d=dtype: _check_loss(s, d)
        if _installed("fla") and s.device.type == "cuda":
            checks[f"kda_fla_{name}"] = lambda d=dtype: _check_kda(s, d, "fla")
            checks[f"gated_delta_fla_{name}"] = lambda d=dtype: _check_kda(s, d, "fla", "gated_delta")
            checks[f"kda_decode_fla_{name}"] = lambda d=dtype: _check_kda_decode(s, d)
    if s.dry:
        checks = {name: check for name, check in checks.items() if name in DRY_CHECKS}
    errors, failed = {}, []
    for name, check in checks.items():
        try:
            errors[name] = round(check(), 6)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
            failed.append(name)
            continue
        if not errors[name] <= TOLERANCE[name.rsplit("_", 1)[1]]:
            failed.append(name)
    if failed:
        raise AssertionError(f"over tolerance or failed: {failed}; errors {errors}")
    return {"rmse_ratio": errors, "tolerance": TOLERANCE, "kda_saved_bytes": _kda_saved_bytes(s)}


def _count_syncs(s: Setting, fn) -> int | None:
    """Host syncs fn makes (CUDA sync debug mode); None on CPU, where there is no such thing."""
    import torch

    if s.device.type != "cuda":
        fn()
        return None
    s.sync()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def stage_syncs(s: Setting) -> dict:
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from moetune.kernels.kda import chunk_kda
    from moetune.kernels.sparse_attention import sparse_attention
    from moetune.workers.families import REGISTRY
    from moetune.workers.experts.module import ExpertParallelExperts
    from moetune.workers.experts.placement import placement_at

    config = REGISTRY["qwen3_moe"].tiny_config()
    experts = ExpertParallelExperts(Qwen3MoeExperts(config), placement_at(config.to_dict(), 1, 0), lora_rank=8)
    experts = experts.to(s.device)
    tokens, top_k = 64, config.num_experts_per_tok
    index = torch.randint(0, config.num_experts, (tokens, top_k), device=s.device)
    weights = torch.rand(tokens, top_k, device=s.device).softmax(-1)
    x = torch.randn(tokens, config.hidden_size, device=s.device, requires_grad=True)
    run_moe = lambda: experts(x, index, weights).sum().backward()  # noqa: E731
    run_moe()  # warm-up: Triton compiles outside the count
    q, k, v, g, beta = _leaves(s.device, torch.float32, (1, 128, 2, 32), (1, 128, 2, 32), (1, 128, 2, 32),
                               (1, 128, 2, 32), (1, 128, 2))
    run_kda = lambda: chunk_kda(q, k, v, -g.detach().abs(), beta.detach().sigmoid())  # noqa: E731
    run_kda()
    q_lat, kv = _leaves(s.device, torch.float32, (1, 128, 4, 24), (1, 128, 1, 24))
    indices = torch.randperm(128, device=s.device)[:16].int().expand(1, 128, 16).contiguous()  # unique per row
    run_sparse = lambda: sparse_attention(q_lat, kv, kv[..., :16], indices, 0.2).sum().backward()  # noqa: E731
    run_sparse()
    return {"moe_layer_fwd_bwd": _count_syncs(s, run_moe), "kda_layer_fwd": _count_syncs(s, run_kda),
            "sparse_attention_fwd_bwd": _count_syncs(s, run_sparse)}


def _job_step(s: Setting, family: str, zero: int, kernels: bool, steps: int) -> list[float]:
    import torch

    from moetune.api.models.job_create import JobCreate
    from moetune.api.models.run_config import resolve_run_config
    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.families import REGISTRY, apply_kernel_swaps, auto_model_class
    from moetune.workers.model import trainable_model
    from moetune.workers.experts.placement import job_placement

    spec = resolve_run_config(JobCreate(
        model="file:///unused", training_file="file:///unused",
        lora={"rank": 8, "alpha": 16, "dropout": 0.0, "train_experts": True},
        training={"max_steps": steps, "global_batch_size": 2, "micro_batch_size": 2, "learning_rate": 1e-2,
                  "warmup_ratio": 0.0, "custom_kernels": kernels, "activation_checkpointing": False},
        parallelism={"num_workers": 1, "zero_stage": zero}), seed=0)
    fam = REGISTRY[family]
    config = fam.tiny_config()
    vocab_size = getattr(config, "text_config", config).vocab_size  # multimodal configs keep it in text_config
    torch.manual_seed(0)
    model = auto_model_class(config).from_config(config, dtype=torch.float32)
    if kernels:
        apply_kernel_swaps(model)
    dtype = torch.bfloat16 if s.device.type == "cuda" else torch.float32
    model = model.to(s.device, dtype)
    torch.manual_seed(1)
    placement = job_placement(config.to_dict(), spec.parallelism, spec.lora)
    model = trainable_model(model, spec.lora, spec.training, placement)
    engine, _ = build_engine(model, spec.training, spec.parallelism, 1, steps, bf16=dtype == torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab_size, (2, 64 if not s.dry else 16), generator=gen).to(s.device)
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def _job_family() -> str:
    """glm5_next (KDA, sparse attention and MoE kernels in one model) where this transformers has it."""
    from moetune.workers.families import REGISTRY

    try:
        REGISTRY["glm5_next"].tiny_config()
        return "glm5_next"
    except (ImportError, AttributeError, KeyError, ValueError):
        return "qwen3_moe"


@contextlib.contextmanager
def _process_group(s: Setting, rank: int, world: int, store: str | None = None):
    """torch.distributed over a file store (no port to collide with on a shared host), this rank on its own GPU."""
    import torch
    import torch.distributed as dist

    if s.dry:
        # the CPU rehearsal: DeepSpeed's CPU backend would JIT-build its shared-memory comm op (C++, minutes on 2
        # cores in a fresh venv, where the prebuilt one's paths do not match); a device run talks NCCL without it
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        torch.cuda.set_device(rank)
    store = store or os.path.join(tempfile.mkdtemp(), "store")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group(s.backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank_entry(rank: int, dry: bool, world: int, store: str, target: str, args: tuple) -> None:
    """A spawned rank: `target` ("module:function") run as fn(rank, world, *args, device=its device)."""
    import importlib

    _moetune_from_checkout()
    s = Setting(dry)
    module, name = target.split(":")
    with _process_group(s, rank, world, store):
        device = s.device if s.dry else __import__("torch").device("cuda", rank)
        getattr(importlib.import_module(module), name)(rank, world, *args, device=device)


# The dry run's ranks fork from a server that imported these once: spawned, each rank spent ~10 s of a CPU on them.
# moetune comes after, in the rank (it may be no installed package: _moetune_from_checkout).
DRY_RANK_PRELOAD = ["torch", "transformers", "deepspeed", "peft"]


def _ranks(s: Setting, world: int, target: str, *args) -> None:
    """Runs `target` on `world` fresh processes (one GPU each), the way a job's ranks run (and with none of an
    earlier stage's process groups, which DeepSpeed keeps by name): spawned, or in the dry run forked from a
    server process that did nothing but import DRY_RANK_PRELOAD."""
    import torch.multiprocessing as mp

    store = os.path.join(tempfile.mkdtemp(), "store")
    if s.dry:
        mp.set_forkserver_preload(DRY_RANK_PRELOAD)
    mp.start_processes(_rank_entry, args=(s.dry, world, store, target, args), nprocs=world, join=True,
                       start_method="forkserver" if s.dry else "spawn")


def _gpus(s: Setting) -> int:
    """Ranks a multi-rank stage can run: two on the CPU rehearsal (gloo), one per GPU on a device."""
    import torch

    return 2 if s.dry else torch.cuda.device_count()


def stage_builder_step(s: Setting) -> dict:
    """Tiny Kimi K3 (MXFP4 experts kept packed, expert LoRA) through build_model("train") under ZeRO-3 with the load
    partitioner, the loss head and the MoE metrics hooks, one step on the device: a tensor moetune left on the host
    fails here ("Expected all tensors to be on the same device"), which the CPU suite can only simulate."""
    import torch

    from bench.support.harness import spec, write_released_checkpoint

    folder = tempfile.mkdtemp()
    model_dir = write_released_checkpoint(os.path.join(folder, "k3"), "kimi_k3")
    job = spec(ep=1, zero=3, train_experts=True, world=1)
    _ranks(s, 1, "bench.support.builder_step:builder_step", model_dir, job.model_dump_json(),
           os.path.join(folder, "out"))
    result = torch.load(os.path.join(folder, "out", "rank0.pt"))
    if result["on_meta"]:
        raise AssertionError(f"tensors made on the host by default: {result['on_meta']}")
    return {"loss": result["loss"], "moe_layers": result["layers"], "figures": result["figures"]}


def stage_images_zero3(s: Setting) -> dict:
    """An image model (qwen3_5_moe, its vision tower wide enough that ZeRO-3 gathers it) under ZeRO-3, rank 1's
    micro-batch without an image (rank 0 alone on one GPU: its imageless micro-batch takes the blank-image path on
    the device): ranks whose vision modules ran out of step would hang here."""
    from moetune.workers.families import REGISTRY
    from moetune.workers.tiny import write_tiny_multimodal_checkpoint
    from bench.support.harness import spec
    from bench.support.image_batches import wide_vision

    world = min(2, _gpus(s))
    folder = tempfile.mkdtemp()
    model_dir = write_tiny_multimodal_checkpoint(os.path.join(folder, "vl"),
                                                 wide_vision(REGISTRY["qwen3_5_moe"].tiny_config))
    job = spec(ep=world, zero=3, world=world)
    _ranks(s, world, "bench.support.image_batches:run_image_ep", model_dir, job.model_dump_json(),
           os.path.join(folder, "out"), world - 1)
    import torch

    return {"ranks": world, "losses": [torch.load(os.path.join(folder, "out", f"rank{r}.pt"))["loss"]
                                       for r in range(world)]}


def stage_ep2_export(s: Setting) -> dict:
    """EP=2 adapter export against the ranks' own expert factors, bit for bit (NCCL writes a gather's receive
    buffers as dense bytes: a strided one scrambles the other ranks' B)."""
    from bench.support.export_check import export_mismatches

    if _gpus(s) < 2:
        return {"skipped": "needs 2 GPUs (NCCL refuses two ranks on one GPU)"}
    out = tempfile.mkdtemp()
    _ranks(s, 2, "bench.support.export_check:export_round_trip", out)
    wrong = export_mismatches(out, 2)
    if wrong:
        raise AssertionError(f"exported expert LoRA differs from the ranks' own: {wrong}")
    return {"ranks": 2, "identical": True}


def stage_context_parallel(s: Setting) -> dict:
    """KDA split over two CP ranks against the unsplit kernel (bench.support.context_check): moetune's CP, and fla's
    where it is installed."""
    if _gpus(s) < 2:
        return {"skipped": "needs 2 GPUs (a CP group's ranks each on their own)"}
    seq, heads, dim = (96, 2, 16) if s.dry else (32768, 16, 128)
    out = tempfile.mkdtemp()
    _ranks(s, 2, "bench.support.context_check:context_kda_check", seq, heads, dim, out)
    ranks = [json.loads(pathlib.Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    tolerance = 1e-4 if s.dry else 2e-2  # fp32 on the CPU rehearsal; bf16 inputs on a device
    result = {"tokens": seq, "heads": heads, "head_dim": dim, "tolerance": tolerance}
    for impl, first in ranks[0].items():
        if "skipped" in first:
            result[impl] = first
            continue
        worst = max(rank[impl]["rmse"] for rank in ranks)
        result[impl] = {"rmse": worst, "split_ms": max(rank[impl]["split_ms"] for rank in ranks),
                        "unsplit_ms": ranks[0][impl]["unsplit_ms"]}
        if worst > tolerance:
            raise AssertionError(f"{impl}'s context-parallel KDA differs from its unsplit kernel: {result}")
    if "split_ms" in result.get("fla", {}):
        result["fla_vs_moetune_speedup"] = result["moetune"]["split_ms"] / result["fla"]["split_ms"]
    return result


def stage_job_step(s: Setting) -> dict:
    missing = [n for n in ("deepspeed", "pydantic") if not _installed(n)]
    if missing:
        return {"skipped": f"{', '.join(missing)} not installed (see the docstring for the wheels)"}
    family = _job_family()
    with _process_group(s, 0, 1):
        runs = {f"zero{z}_{'kernels' if k else 'plain'}": _job_step(s, family, z, k, 2)
                for z in ((2,) if s.dry else (2, 3)) for k in (True, False)}
    tolerance = 1e-4 if s.device.type == "cpu" else 3e-2  # bf16 kernels vs bf16 transformers modules
    gaps = {z: abs(runs[f"zero{z}_kernels"][0] - runs[f"zero{z}_plain"][0]) for z in ((2,) if s.dry else (2, 3))}
    if any(gap > tolerance * abs(runs[f"zero{z}_plain"][0]) for z, gap in gaps.items()):
        raise AssertionError(f"custom kernels change the first loss: {runs}")
    return {"family": family, "backend": s.backend, "losses": runs}


def _bench_kda(s: Setting, peaks: dict) -> dict:
    import torch

    t, h, d = (32, 1, 16) if s.dry else (8192, 16, 128)
    q, k, v, g, beta = _leaves(s.device, torch.bfloat16, (1, t, h, d), (1, t, h, d), (1, t, h, d),
                               (1, t, h, d), (1, t, h), grad=False)
    g, beta = -g.float().abs() * 0.1, beta.float().sigmoid().to(beta.dtype)  # fp32 gates, as the models give
    flops = 2 * t * h * (4 * 64 * d + 3 * d * d)  # per token: the chunk's pairwise rows and the state products
    out = {"shape": [t, h, d]}
    names = ("moetune", "fla") if _installed("fla") and s.device.type == "cuda" else ("moetune",)
    kernels = {name: _cuda_kda(name) for name in names}  # as chunk_kda calls them: q and k normalised inside
    impls = {f"{name}_kda": lambda fn=fn: fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
             for name, fn in kernels.items()}
    with torch.no_grad():
        for name, fn in impls.items():
            sec = s.seconds(fn)
            out[name] = {"ms": round(sec * 1e3, 3), "tflops": round(flops / sec / 1e12, 2),
                         "of_peak": round(flops / sec / 1e12 / peaks["peak_bf16_tflops"], 4)}
    return out


def _selections(s: Setting, seq: int, topk: int) -> dict:
    """Two causal top-k selections: the latest keys (every key block the dK/dV pass visits is full) and random
    keys (the most (query, key block) pairs it can meet); -1 where the prefix is shorter."""
    import torch

    pos = torch.arange(seq, device=s.device)
    latest = pos[:, None] - torch.arange(topk, device=s.device)
    random = torch.full((seq, topk), -1, dtype=torch.int32, device=s.device)
    gen = torch.Generator(device=s.device).manual_seed(0)
    for start in range(0, seq, 1024):
        rows = pos[start:start + 1024]
        score = torch.rand(len(rows), seq, generator=gen, device=s.device).masked_fill(pos > rows[:, None], -1)
        best, idx = score.topk(min(topk, seq), dim=-1)
        random[start:start + 1024, :idx.shape[1]] = torch.where(best >= 0, idx, -1).int()
    return {"latest": torch.where(latest >= 0, latest, -1)[None].int(), "random": random[None]}


def _bench_sparse(s: Setting, peaks: dict) -> dict:
    """glm5_next's indexed attention at 8K/32K: over the shared latent (64 heads, 512 wide; what the family runs)
    and, at 8K, over per-head keys (transformers' expanded MLA, 256/256), forward and forward + backward, against
    dense causal SDPA (flash) at the expanded head dims."""
    import torch
    import torch.nn.functional as F

    from moetune.kernels.sparse_attention import sparse_attention

    out = {}
    h, latent, head, topk = (2, 16, 16, 8) if s.dry else (64, 512, 256, 2048)
    for seq in ((32,) if s.dry else (8192, 32768)):
        if s.spent():
            out[f"{seq}"] = s.spent()
            continue
        q_lat, kv = _leaves(s.device, torch.bfloat16, (1, seq, h, latent), (1, seq, 1, latent), scale=0.1)
        q, k, v = _leaves(s.device, torch.bfloat16, (1, seq, h, head), (1, seq, h, head), (1, seq, h, head),
                          scale=0.1)
        row = {}
        for name, indices in _selections(s, seq, topk).items():
            def absorbed():
                return sparse_attention(q_lat, kv, kv, indices, latent**-0.5, backend="triton")

            def expanded():
                return sparse_attention(q, k, v, indices, head**-0.5, backend="triton")

            forms = (("latent", absorbed), ("per_head", expanded)) if seq <= 8192 else (("latent", absorbed),)
            for form, fn in forms:  # per-head keys at 32K: minutes, not the check's budget
                with torch.no_grad():
                    fwd = s.seconds(fn, reps=3)
                grad = torch.ones_like(q_lat if form == "latent" else q)  # the output's shape: values as wide as q
                both = s.seconds(lambda: torch.autograd.grad(fn(), (q_lat, kv) if form == "latent" else (q, k, v),
                                                              grad), reps=3)
                row[f"{form}_{name}"] = {"fwd_ms": round(fwd * 1e3, 3), "fwd_bwd_ms": round(both * 1e3, 3)}
        qd, kd, vd = (x.transpose(1, 2) for x in (q, k, v))
        with torch.no_grad():
            dense = s.seconds(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True), reps=3)
        dense_both = s.seconds(lambda: torch.autograd.grad(F.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True), (q, k, v), torch.ones(1, h, seq, head, dtype=torch.bfloat16,
                                                                 device=s.device)), reps=3)
        row["sdpa"] = {"fwd_ms": round(dense * 1e3, 3), "fwd_bwd_ms": round(dense_both * 1e3, 3)}
        kept = min(topk, seq)
        latent_flops = 2 * seq * kept * h * 2 * latent  # scores and values over the latent, forward
        row["latent_latest_fwd_tflops"] = round(latent_flops / row["latent_latest"]["fwd_ms"] / 1e9, 2)
        row["latent_latest_of_peak"] = round(row["latent_latest_fwd_tflops"] / peaks["peak_bf16_tflops"], 4)
        for name in ("latest", "random"):
            row[f"speedup_vs_sdpa_{name}"] = round(row["sdpa"]["fwd_bwd_ms"] / row[f"latent_{name}"]["fwd_bwd_ms"], 2)
            if f"per_head_{name}" in row:
                row[f"latent_vs_per_head_{name}"] = round(row[f"per_head_{name}"]["fwd_bwd_ms"]
                                                          / row[f"latent_{name}"]["fwd_bwd_ms"], 2)
        out[f"{seq}"] = row
        del q_lat, kv, q, k, v
    return out


def stage_sparse_dkv(s: Setting) -> dict:
    """The sparse attention backward with each dK/dV pass over glm5_next's latent (64 heads, 512 wide, top-2048;
    dQ included, the same in both) for the latest and for random keys at 8K and 32K: which is faster, and whether
    dkv_order's choice from the shapes takes it. The two passes' gradients must agree."""
    import torch

    from moetune.kernels.sparse_attention import triton_impl

    h, latent, topk = (2, 16, 8) if s.dry else (64, 512, 2048)
    out, disagree = {}, []
    for seq in ((32,) if s.dry else (8192, 32768)):
        q, kv, grad = _leaves(s.device, torch.bfloat16, (1, seq, h, latent), (1, seq, 1, latent), (1, seq, h, latent),
                              scale=0.1, grad=False)
        for name, indices in _selections(s, seq, topk).items():
            if s.spent():
                out[f"{seq}_{name}"] = s.spent()
                continue
            o, lse = triton_impl.forward(q, kv, kv, indices, latent**-0.5)
            ms, dkv = {}, {}
            for order in triton_impl.DKV_ORDERS:
                def backward(order=order):  # keeps its dK/dV: the timed runs' last one is compared
                    dkv[order] = triton_impl.backward(q, kv, kv, indices, latent**-0.5, o, lse, grad, order=order)[1]

                ms[order] = round(s.seconds(backward, reps=3) * 1e3, 3)
            rmse = _rmse(dkv["query_major"], dkv["key_major"])
            if not rmse <= TOLERANCE["bfloat16"]:
                disagree.append(f"{seq}_{name}")
            chosen = triton_impl.dkv_order(seq, topk)
            out[f"{seq}_{name}"] = {"backward_ms": ms, "query_major_speedup": round(ms["key_major"]
                                                                                   / ms["query_major"], 2),
                                    "chosen": chosen, "chosen_is_faster": ms[chosen] == min(ms.values()),
                                    "rmse_between_orders": round(rmse, 6)}
            del o, lse, dkv
        del q, kv, grad
    if disagree:
        raise AssertionError(f"the dK/dV orders disagree beyond {TOLERANCE['bfloat16']} at {disagree}: {out}")
    return out


def _bench_moe(s: Setting, peaks: dict) -> dict:
    """Forward of the grouped LoRA GEMM, Triton vs torch grouped_mm, at the seed model's expert widths (gate_up
    7168 -> 4096, down 2048 -> 7168) and a small one; `choice_table` is kernels/moe/choice.py's MEASURED."""
    import torch

    from moetune.kernels.moe import moe_lora_grouped

    shapes = [(32, 48)] if s.dry else [(2048, 1536), (7168, 4096), (2048, 7168)]
    experts, rank, tokens = (2, 16, 64) if s.dry else (32, 16, 16384)
    counts = torch.full((experts,), tokens // experts, device=s.device)
    out, table = {}, {}
    for hidden, inter in shapes:
        if s.spent():
            out[f"{hidden}x{inter}"] = s.spent()
            continue
        x, a, b = _leaves(s.device, torch.bfloat16, (tokens, hidden), (experts, hidden, rank),
                          (experts, rank, inter), scale=0.02, grad=False)
        w = _leaves(s.device, torch.bfloat16, (experts, hidden, inter), scale=hidden**-0.5, grad=False)[0]
        flops = 2 * tokens * hidden * inter
        row = {}
        for backend in ("triton", "torch"):  # torch: grouped_mm
            with torch.no_grad():
                sec = s.seconds(lambda: moe_lora_grouped(x, counts, w, a, b, 2.0, backend=backend))
            row[backend] = {"ms": round(sec * 1e3, 3), "tflops": round(flops / sec / 1e12, 2),
                            "of_peak": round(flops / sec / 1e12 / peaks["peak_bf16_tflops"], 4)}
        row["triton_vs_grouped_mm"] = round(row["torch"]["ms"] / row["triton"]["ms"], 2)
        out[f"{hidden}x{inter}"] = row
        table[f"({hidden}, {inter})"] = "triton" if row["triton_vs_grouped_mm"] > 1 else "torch"
        del x, a, b, w
    return {"experts": experts, "tokens": tokens, "rank": rank, "shapes": out, "choice_table": table,
            "triton_vs_grouped_mm": min((r["triton_vs_grouped_mm"] for r in out.values() if "skipped" not in r),
                                        default=None)}


def stage_bench(s: Setting, peaks: dict) -> dict:
    return {"kda": _bench_kda(s, peaks), "sparse_attention": _bench_sparse(s, peaks), "moe": _bench_moe(s, peaks)}


def _status(data: dict) -> str:
    return "skipped" if "skipped" in data else ("error" if "error" in data else "ok")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every stage on this CPU, tiny shapes")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported
    _moetune_from_checkout()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --dry-run)")
    if args.dry_run:
        torch.set_num_threads(1)  # tiny shapes: more threads only contend
    s, report = Setting(args.dry_run), Report()
    report.plan()
    env = report.run("env", stage_env, s)
    correctness = report.run("correctness", stage_correctness, s)
    syncs = report.run("syncs", stage_syncs, s)
    job = report.run("job_step", stage_job_step, s)
    placed = {stage: report.run(stage, fn, s) for stage, fn in (
        ("builder_step", stage_builder_step), ("images_zero3", stage_images_zero3), ("ep2_export", stage_ep2_export),
        ("context_parallel", stage_context_parallel))}
    dkv = report.run("sparse_dkv", stage_sparse_dkv, s)
    bench = report.run("bench", stage_bench, s, env) if "error" not in env else {}
    summary = {"failed": ",".join(report.failures) or "none", "dry_run": args.dry_run,
               "worst_rmse": max((v for v in correctness.get("rmse_ratio", {}).values()
                                  if isinstance(v, float)), default=None),
               "moe_syncs": syncs.get("moe_layer_fwd_bwd"), "kda_syncs": syncs.get("kda_layer_fwd"),
               "sparse_syncs": syncs.get("sparse_attention_fwd_bwd"),
               **{stage: _status(data) for stage, data in (("job_step", job), *placed.items())},
               "cp_fla_vs_moetune_speedup": placed["context_parallel"].get("fla_vs_moetune_speedup"),
               "moe_triton_vs_grouped_mm": bench.get("moe", {}).get("triton_vs_grouped_mm"),
               **{f"sparse_dkv_{case}_query_major_speedup": row.get("query_major_speedup")
                  for case, row in dkv.items() if isinstance(row, dict) and "backward_ms" in row},
               **{f"sparse_{seq}_vs_sdpa_{sel}": row.get(f"speedup_vs_sdpa_{sel}")
                  for seq, row in bench.get("sparse_attention", {}).items() for sel in ("latest", "random")}}
    print("RESULT " + " ".join(f"{k}={v}" for k, v in summary.items()), flush=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
