"""P1: LoRA train-step tokens/s of moetune vs transformers + PEFT on the tiny seed-family (kimi_linear) model.

Both run in the same two gloo processes (2 workers, one thread each), one after the other, on the same batches:
- baseline: transformers' model as is (eager experts loop, its own KDA code), PEFT LoRA on every linear,
  DeepSpeed ZeRO-2 without expert parallelism;
- moetune: the same model and LoRA with moetune's kernel swaps (kernels.kda in the KDA layers), expert
  parallelism EP=2 (tokens to their experts by all-to-all, each rank holds half of the experts) whose local
  experts run kernels.moe's grouped GEMMs, DeepSpeed ZeRO-2.

Time split per step (ms, mean over steps and ranks), measured with wall-clock hooks:
  attention  = forward + backward of the attention modules (KDA and MLA layers);
  experts    = forward + backward of the routed-experts module (moetune: includes its all-to-all);
  all_to_all = time inside the token and count all-to-alls (a part of experts; includes waiting for the peer);
  optimizer  = engine.step() (ZeRO-2 optimizer step and parameter all-gather);
  other      = the rest (embeddings, norms, router, shared experts, LM head and loss, ZeRO-2 gradient reduction).
With `--profile N`, rank 0's timed moetune steps also run under torch.profiler and the N ops with the most self
CPU time are printed before the RESULT (the profiler's own overhead inflates the step times of that run).
The last line is `RESULT speedup=<x> moetune_tok_s=<a> baseline_tok_s=<b>`.

    python bench/train_step.py [--steps 8] [--micro 4] [--seq 128] [--profile 25]
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

import torch
import torch.distributed as dist

from bench.step_args import step_arguments
from bench.support.op_profile import print_top_ops
from bench.support.tiny_models import batch, plain_model
from bench.support.harness import launch, spec

FAMILY = "kimi_linear"
ATTENTION = ("KimiLinearAttention", "KimiLinearDeltaAttention")
PARTS = ("attention", "experts", "all_to_all", "optimizer", "other")


class StepTimer:
    """Wall-clock time per part. A module's backward window opens when the gradient of its output is complete
    and closes when the gradient of its (first) input is; windows still open when backward returns (the first
    layer's input needs no gradient) close then."""

    def __init__(self):
        self.totals = defaultdict(float)
        self.open_backward = []  # [part, start] still waiting for their input gradient

    def watch(self, module, part: str) -> None:
        def pre(mod, args, kwargs):
            mod._bench_start = time.perf_counter()
            x = args[0] if args else kwargs.get("hidden_states")
            mod._bench_input = x if torch.is_tensor(x) and x.requires_grad else None

        def post(mod, args, kwargs, output):
            self.totals[part] += time.perf_counter() - mod._bench_start
            out = output[0] if isinstance(output, tuple) else output
            if not out.requires_grad:
                return
            window, x = [part, None], mod._bench_input
            out.register_hook(lambda grad: self._open(window))
            if x is not None:
                x.register_hook(lambda grad: self._close(window))

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)

    def _open(self, window):
        window[1] = time.perf_counter()
        self.open_backward.append(window)

    def _close(self, window):
        if window in self.open_backward:
            self.open_backward.remove(window)
            self.totals[window[0]] += time.perf_counter() - window[1]

    def backward_done(self):
        now = time.perf_counter()
        for part, start in self.open_backward:
            self.totals[part] += now - start
        self.open_backward.clear()

    def timed_all_to_all(self, fn):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals["all_to_all"] += time.perf_counter() - start

        return wrapped


def _engine(world: int, moetune: bool, args):
    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.families import REGISTRY, apply_kernel_swaps
    from moetune.workers.model import trainable_model
    from moetune.workers.experts.placement import job_placement

    fam = REGISTRY[FAMILY]
    model = plain_model(fam)
    model.config._experts_implementation = "eager"  # the baseline's experts: transformers' per-expert loop
    job = spec(ep=2 if moetune else 1, zero=2, steps=args.warmup + args.steps, micro=args.micro, kernels=moetune)
    if moetune:
        apply_kernel_swaps(model)
    torch.manual_seed(1)
    placement = job_placement(model.config.to_dict(), job.parallelism, job.lora)
    model = trainable_model(model, job.lora, job.training, placement)
    engine, _ = build_engine(model, job.training, job.parallelism, world, job.training.max_steps, bf16=False)
    return engine, fam


def _measure(rank: int, world: int, moetune: bool, args) -> dict:
    engine, fam = _engine(world, moetune, args)
    timer = StepTimer()
    for module in engine.module.modules():
        if type(module).__name__ in ATTENTION:
            timer.watch(module, "attention")
    for _, block in fam.moe_blocks(engine.module):
        timer.watch(getattr(block, fam.experts), "experts")
    from moetune.workers.comm import checked

    stock_all_to_all = checked.all_to_all_single
    checked.all_to_all_single = timer.timed_all_to_all(stock_all_to_all)
    profiler = torch.profiler.profile() if args.profile and moetune and rank == 0 else None
    try:
        wall = 0.0
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                timer.totals.clear()
                if profiler is not None:
                    profiler.start()
            data = batch(rank, step, args.micro, args.seq)
            dist.barrier()
            start = time.perf_counter()
            loss = engine(**data).loss
            engine.backward(loss)
            timer.backward_done()
            opt_start = time.perf_counter()
            engine.step()
            timer.totals["optimizer"] += time.perf_counter() - opt_start
            if step >= args.warmup:
                wall += time.perf_counter() - start
    finally:
        checked.all_to_all_single = stock_all_to_all
        if profiler is not None:
            profiler.stop()
    parts = {p: timer.totals[p] / args.steps * 1e3 for p in PARTS if p != "other"}
    parts["other"] = wall / args.steps * 1e3 - sum(v for p, v in parts.items() if p != "all_to_all")
    if profiler is not None:
        print_top_ops(profiler, args.profile, args.steps, "rank 0 moetune")
    return {"step_ms": wall / args.steps * 1e3, **parts}


def _worker(rank: int, world: int, args, out_file: str) -> None:
    results = {name: _measure(rank, world, name == "moetune", args) for name in ("baseline", "moetune")}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_file)


def main() -> None:
    args = step_arguments(__doc__, steps=8, warmup=2, profile=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    world = 2
    out_file = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moetune-bench-train-step-{os.getpid()}.pt")
    load_before = os.getloadavg()[0]
    launch(_worker, world, args, out_file)
    ranks = torch.load(out_file)
    os.remove(out_file)

    tokens = world * args.micro * args.seq
    print(f"{FAMILY} tiny model, {world} workers (gloo, 1 thread each), {tokens} tokens per step, "
          f"{args.steps} timed steps after {args.warmup} warm-up; 1-min load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs (other work on the machine skews both runs)")
    print(f"{'':10s} {'tok/s':>9s} {'step ms':>9s} " + " ".join(f"{p:>10s}" for p in PARTS))
    tok_s = {}
    for name in ("baseline", "moetune"):
        mean = {k: sum(r[name][k] for r in ranks) / world for k in ranks[0][name]}
        tok_s[name] = tokens / (max(r[name]["step_ms"] for r in ranks) / 1e3)
        print(f"{name:10s} {tok_s[name]:9.0f} {mean['step_ms']:9.1f} " + " ".join(f"{mean[p]:10.1f}" for p in PARTS))
    speedup = tok_s["moetune"] / tok_s["baseline"]
    print(f"RESULT speedup={speedup:.2f} moetune_tok_s={tok_s['moetune']:.0f} baseline_tok_s={tok_s['baseline']:.0f}")


if __name__ == "__main__":
    main()
