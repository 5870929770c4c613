"""Image rows: LoRA train-step throughput of moetune vs transformers + PEFT on a tiny multimodal model.

Both run in the same two gloo processes (one thread each), one after the other, on the same micro-batches of the
solid-colour image rows (workers.tiny.tiny_image_rows: one 32- or 64-pixel image a row, through the checkpoint's own
image processor, image tokens repeated per merged patch):
- baseline: stock transformers *ForConditionalGeneration (eager experts loop), PEFT LoRA on every text linear,
  cross-entropy over its [tokens, vocab] logits, DeepSpeed ZeRO-2 without expert parallelism;
- moetune: the same model and LoRA with the family's kernel swaps, EP=2 (each rank half of the routed experts, on
  kernels.moe's grouped GEMMs) and the loss through the output layer (SupervisedImageMethod), ZeRO-2.
The vision tower runs (frozen) in both. Tokens are every token of the rows, image tokens included. On CPU,
qwen3_5_moe's swap is its Gated DeltaNet core on kernels.kda
(16-token chunks at its 16-wide heads, over the rows padded to the micro-batch's longest, ~37 tokens, 32 a rank:
image rows are not packed; the core takes ~9 ms fwd+bwd a layer of the layer's ~16), so the core is not all of
the step; before the swap the ratio was EP and the loss head alone (0.96-1.18; 0.98 on 2026-12-02), 0.85 with it
on the same busy 2-core machine (load 4-5: runs there differ by 1.7x, see the load averages printed); 1.06 -> 1.11
with the contiguous chunk scan (2026-12-03, load 3-4, moetune step 238 -> 236 ms: the EP step is not core-bound);
1.32-1.51 (median 1.41, seven runs) on a quiet machine with the same-host exchange
(workers.experts.local_exchange: the 20 all-to-alls of a step took 28-33 ms through gloo, 6-13 ms over Unix
sockets, mostly rank 0 waiting for rank 1, whose experts get 28 % more rows). glm5_next adds its KDA and
sparse-attention swaps (2.3x). The first losses must agree: same model, LoRA draw and rows.
Last line: `RESULT image_step_speedup=<moetune tok/s over baseline> image_tokens_per_s=<moetune's>`.

    python bench/images.py [--family qwen3_5_moe|glm5_next] [--steps 6] [--micro 32] [--profile 25]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

import torch
import torch.distributed as dist

from bench.support.image_batches import image_method, image_model
from bench.support.op_profile import print_top_ops
from bench.support.harness import launch, spec


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


def _measure(rank: int, world: int, model_dir: str, moetune: bool, args, method, batches) -> dict:
    engine = _engine(model_dir, world, moetune, args, method)
    profiler = torch.profiler.profile() if args.profile and moetune and rank == 0 else None
    wall, losses = 0.0, []
    for step, batch in enumerate(batches):
        if step == args.warmup and profiler is not None:
            profiler.start()
        dist.barrier()
        start = time.perf_counter()
        loss = _loss(engine, method, batch, moetune)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step >= args.warmup:
            wall += time.perf_counter() - start
    if profiler is not None:
        profiler.stop()
        print_top_ops(profiler, args.profile, args.steps, "rank 0 moetune")
    tokens = sum(b.tokens for b in batches[args.warmup:])
    return {"step_s": wall / args.steps, "tokens": tokens / args.steps, "first_loss": losses[0]}


def _worker(rank: int, world: int, model_dir: str, args, out_file: str) -> None:
    method = image_method(model_dir)
    batches = _batches(method, rank, args)
    results = {name: _measure(rank, world, model_dir, name == "moetune", args, method, batches)
               for name in ("baseline", "moetune")}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_file)


def main() -> None:
    from moetune.workers.families import REGISTRY
    from moetune.workers.tiny import write_tiny_multimodal_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3_5_moe", choices=("qwen3_5_moe", "glm5_next"))
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro", type=int, default=32, help="image rows per worker and step")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the timed moetune steps on rank 0 and print the top N ops (inflates its times)")
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
          f"worker and step, {args.steps} timed steps after {args.warmup} warm-up; 1-min load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs")
    print(f"{'':10s} {'tok/s':>9s} {'step ms':>9s} {'tokens/step':>12s} {'first loss':>11s}")
    tok_s = {}
    for name in ("baseline", "moetune"):
        tokens = sum(r[name]["tokens"] for r in ranks)
        slowest = max(r[name]["step_s"] for r in ranks)  # a step ends when both ranks are done
        tok_s[name] = tokens / slowest
        loss = sum(r[name]["first_loss"] for r in ranks) / world
        print(f"{name:10s} {tok_s[name]:9.0f} {slowest * 1e3:9.1f} {tokens:12.0f} {loss:11.4f}")
    print(f"RESULT image_step_speedup={tok_s['moetune'] / tok_s['baseline']:.2f} "
          f"image_tokens_per_s={tok_s['moetune']:.0f}")


if __name__ == "__main__":
    main()
