"""Image rows: LoRA train-step throughput of moetune vs transformers + PEFT on a tiny multimodal model.

Both run in the same two gloo processes (one thread each), built side by side and stepped in turns on the same
micro-batches (each round's first alternates; the median step of each is compared, so a machine that slows down
mid-run slows both), of the solid-colour image rows (workers.tiny.tiny_image_rows: one 32- or 64-pixel image a
row, through the checkpoint's own image processor, image tokens repeated per merged patch):
- baseline: stock transformers *ForConditionalGeneration (eager experts loop), PEFT LoRA on every text linear,
  cross-entropy over its [tokens, vocab] logits, DeepSpeed ZeRO-2 without expert parallelism;
- moetune: the same model and LoRA with the family's kernel swaps, LoRA linears fused (workers.lora.fused_linear),
  EP=2 (each rank half of the routed experts, on kernels.moe's grouped GEMMs) and the loss through the output layer
  (SupervisedImageMethod), ZeRO-2.
The vision tower runs (frozen) in both. Tokens are every token of the rows, image tokens included; the rows are
padded to the micro-batch's longest (~37 tokens, 32 a rank), not packed. qwen3_5_moe's swaps on CPU: its Gated
DeltaNet core on kernels.kda (16-token chunks at its 16-wide heads) with the short conv over [B, T, D], and its
multimodal RoPE positions for the whole batch at once (workers.families.qwen3_5_moe.mrope). A Gated DeltaNet layer
takes ~14 ms fwd+bwd, ~8 of them in the core; transformers' takes ~35.
History on this 2-core VM: 0.85-1.18 before the core swap; 1.32-1.51 (median 1.41) with the same-host EP exchange
(workers.experts.local_exchange); 1.26-1.47 (median 1.39) on 2026-12-04 with the runs one after the other. Then on
2026-12-05: the short conv over [B, T, D] (a layer 15.9 -> 14.0 ms), fused LoRA linears (-2.5 % a step in
alternating A/B runs), batched RoPE positions (3.3 ms of each forward); see docs/benchmarks.md for the runs.
glm5_next adds its KDA and sparse-attention swaps. The first losses must agree: same model, LoRA draw and rows.
Last line: `RESULT image_step_speedup=<moetune tok/s over baseline> image_tokens_per_s=<moetune's>`.

    python bench/images.py [--family qwen3_5_moe|glm5_next] [--steps 12] [--micro 32] [--profile 25]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

import torch
import torch.distributed as dist

from bench.support.image_batches import image_method, image_model
from bench.support.op_profile import print_top_ops
from bench.support.harness import launch, spec

RUNS = ("baseline", "moetune")


def _batches(method, rank: int, args) -> list:
    """The same micro-batches for both runs: `micro` image rows per rank and step, other rows per step."""
    from moetune.workers.tiny import tiny_image_rows

    return [method.collate(method.examples(tiny_image_rows(args.micro, seed=1000 * step + rank))[0])
            for step in range(args.warmup + args.steps)]


def _engine(model_dir: str, world: int, moetune: bool, args, method):
    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.families import apply_kernel_swaps
    from moetune.workers.model import trainable_model
    from moetune.workers.experts.placement import job_placement

    model = image_model(model_dir)
    model.config.get_text_config()._experts_implementation = "eager"  # the baseline's: transformers' expert loop
    job = spec(ep=2 if moetune else 1, zero=2, steps=args.warmup + args.steps, micro=args.micro, kernels=moetune)
    if moetune:
        apply_kernel_swaps(model)
    torch.manual_seed(1)
    placement = job_placement(model.config.to_dict(), job.parallelism, job.lora)
    model = trainable_model(model, job.lora, job.training, placement)
    if moetune:
        method.prepare(model)  # the loss through the output layer: no [tokens, vocab] logits
    engine, _ = build_engine(model, job.training, job.parallelism, world, job.training.max_steps, bf16=False)
    return engine


def _loss(engine, method, batch, moetune: bool):
    from moetune.workers.methods.sft import token_loss_sum

    if moetune:
        total = method.loss_sum(engine, batch)
    else:
        total = token_loss_sum(engine(**batch.inputs).logits, batch.labels)
    return total / batch.tokens


def _step(engine, method, batch, moetune: bool) -> tuple[float, float]:
    """One training step after both ranks meet: (seconds, loss)."""
    dist.barrier()
    start = time.perf_counter()
    loss = _loss(engine, method, batch, moetune)
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start, loss.item()


def _worker(rank: int, world: int, model_dir: str, args, out_file: str) -> None:
    """Both engines built side by side, then stepped in turns on the same batch (each round's first alternates): a
    machine that slows down or speeds up mid-run slows both alike."""
    methods = {name: image_method(model_dir) for name in RUNS}  # the method binds to the model it prepares
    batches = _batches(methods["moetune"], rank, args)
    engines = {name: _engine(model_dir, world, name == "moetune", args, methods[name]) for name in RUNS}
    seconds, first_loss = {name: [] for name in RUNS}, {}
    for i, batch in enumerate(batches):
        for name in RUNS if i % 2 == 0 else RUNS[::-1]:
            took, loss = _step(engines[name], methods[name], batch, name == "moetune")
            first_loss.setdefault(name, loss)
            if i >= args.warmup:
                seconds[name].append(took)
    if args.profile:  # as many more moetune steps, untimed: rank 0's profiler inflates them
        profiler = torch.profiler.profile() if rank == 0 else contextlib.nullcontext()
        with profiler:
            for batch in batches[args.warmup:]:
                _step(engines["moetune"], methods["moetune"], batch, True)
        if rank == 0:
            print_top_ops(profiler, args.profile, args.steps, "rank 0 moetune")
    tokens = sum(b.tokens for b in batches[args.warmup:]) / args.steps
    gathered = [None] * world
    dist.all_gather_object(gathered, {"seconds": seconds, "tokens": tokens, "first_loss": first_loss})
    if rank == 0:
        torch.save(gathered, out_file)


def main() -> None:
    from moetune.workers.families import REGISTRY
    from moetune.workers.tiny import write_tiny_multimodal_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3_5_moe", choices=("qwen3_5_moe", "glm5_next"))
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro", type=int, default=32, help="image rows per worker and step")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile as many more moetune steps on rank 0 and print the top N ops")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    world = 2
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        model_dir = write_tiny_multimodal_checkpoint(os.path.join(work, "vl"), REGISTRY[args.family].tiny_config)
        out_file = os.path.join(work, "ranks.pt")
        launch(_worker, world, model_dir, args, out_file)
        ranks = torch.load(out_file)

    print(f"{args.family} tiny multimodal model, {world} workers (gloo, 1 thread each), {args.micro} image rows per "
          f"worker and step, {args.steps} timed steps each after {args.warmup} warm-up, in turns (median step); "
          f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs")
    print(f"{'':10s} {'tok/s':>9s} {'step ms':>9s} {'min-max ms':>13s} {'tokens/step':>12s} {'first loss':>11s}")
    tok_s = {}
    tokens = sum(r["tokens"] for r in ranks)
    for name in RUNS:
        steps = [max(per_rank) for per_rank in zip(*(r["seconds"][name] for r in ranks))]  # both ranks done
        median = statistics.median(steps)
        tok_s[name] = tokens / median
        loss = sum(r["first_loss"][name] for r in ranks) / world
        print(f"{name:10s} {tok_s[name]:9.0f} {median * 1e3:9.1f} {min(steps) * 1e3:6.0f}-{max(steps) * 1e3:<6.0f} "
              f"{tokens:12.0f} {loss:11.4f}")
    print(f"RESULT image_step_speedup={tok_s['moetune'] / tok_s['baseline']:.2f} "
          f"image_tokens_per_s={tok_s['moetune']:.0f}")


if __name__ == "__main__":
    main()
