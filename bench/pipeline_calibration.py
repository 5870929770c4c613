"""Issue 52: the planner's step-time estimate (workers.planner.timing) against measured steps, on four gloo ranks.

Two layouts of the same job (a Qwen3-MoE model wide enough for its matmuls to dominate, `--seq` tokens a row, a
global batch of 8 rows, LoRA on every linear, no recomputation), each run for real in the same four processes:
- ZeRO-3 x EP=2: every rank its own rows, the frozen weights partitioned and gathered each forward and backward;
- PP=2 x EP=2 under ZeRO-2: two stages (workers.pipeline, each its own engine: workers.engine.pipeline) through
  torch.distributed.pipelining's Schedule1F1B, two data-parallel replicas of the pipeline.
The estimate's inputs are measured on the same ranks at the same time: the peak is a matmul's rate with all four
ranks running one at once (`gpu_tflops`, efficiency 1: the CPU's share a rank gets), and both links a gloo
all-gather's bytes per second (one box: NVLink and network alike); gloo's collectives block the rank, so nothing
overlaps (`overlap` false). The step time is the mean of the timed steps
(after one warm-up), the slowest rank's.

The last line is `RESULT pp2_vs_zero3_step_ratio=… estimate_ratio=… ranking_agrees=… zero3_estimate_ratio=…
pp2_estimate_ratio=…` (the last two: estimate over measurement, each layout's).

    python bench/pipeline_calibration.py [--seq 256] [--steps 3]
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

from bench.support.harness import launch, make_engine, spec

WORLD, STAGES, EP, GLOBAL_BATCH = 4, 2, 2, 8
WIDE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2)


def _config():
    from moetune.workers.families import REGISTRY

    return REGISTRY["qwen3_moe"].tiny_config(**WIDE)


def _jobs(steps: int):
    """The ZeRO-3 layout's run config, and the pipelined one's with its layout."""
    zero3 = spec(ep=EP, zero=3, world=WORLD, steps=steps, micro=1, global_batch=GLOBAL_BATCH, checkpointing=False)
    staged = spec(ep=EP, zero=2, world=WORLD, steps=steps, micro=1, global_batch=GLOBAL_BATCH, checkpointing=False)
    return zero3, staged, staged.parallelism.model_copy(update={"pipeline_parallel_size": STAGES})


def _rows(step: int, rank_rows: int, first: int, seq: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(3, vocab, (GLOBAL_BATCH, seq), generator=g)[first:first + rank_rows]


def _timed(run_step, steps: int) -> float:
    """Mean seconds of the timed steps after one warm-up, the slowest rank's."""
    run_step(0)
    dist.barrier()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        run_step(step)
    dist.barrier()
    seconds = torch.tensor([(time.perf_counter() - start) / steps])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def _matmul_rate(seconds: float = 1.5) -> float:
    """Operations per second of one rank's matmul while every rank runs one (the mean over ranks)."""
    a, b = torch.randn(512, 512), torch.randn(512, 1024)
    dist.barrier()
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        done += 1
    rate = torch.tensor([2.0 * 512 * 512 * 1024 * done / (time.perf_counter() - start)])
    dist.all_reduce(rate)
    return float(rate) / dist.get_world_size()


def _gather_rate(elements: int = 1 << 20, repeats: int = 5) -> float:
    """Bytes per second one rank receives in a gloo all-gather of fp32 tensors."""
    mine, out = torch.randn(elements), torch.empty(elements * dist.get_world_size())
    dist.all_gather_into_tensor(out, mine)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_gather_into_tensor(out, mine)
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return repeats * elements * 4 * (dist.get_world_size() - 1) / float(seconds)


def _zero3_seconds(rank: int, seq: int, steps: int) -> float:
    from moetune.workers.methods.sft import token_loss_sum

    job, _, _ = _jobs(steps + 1)
    config = _config()
    engine = make_engine(rank, WORLD, "qwen3_moe", job, config=config)
    per_rank = GLOBAL_BATCH // WORLD

    def step(n: int) -> None:
        rows = _rows(n, per_rank, rank * per_rank, seq, config.vocab_size)
        for m in range(per_rank):
            loss = token_loss_sum(engine(input_ids=rows[m:m + 1]).logits, rows[m:m + 1])
            engine.set_gradient_accumulation_boundary(m == per_rank - 1)
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()

    return _timed(step, steps)


def _pipeline_seconds(rank: int, seq: int, steps: int) -> float:
    from torch.distributed.pipelining import Schedule1F1B

    from bench.support.harness import base_model
    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.engine.pipeline import EngineStage, StageGroups
    from moetune.workers.experts.placement import job_placement
    from moetune.workers.methods.sft import token_loss_sum
    from moetune.workers.model import trainable_model
    from moetune.workers.pipeline.split import stage_bounds
    from moetune.workers.pipeline.stages import stage_module

    _, job, layout = _jobs(steps + 1)
    config = _config()
    place, replicas = layout.coordinates(rank), layout.data_parallel_size
    model = base_model("qwen3_moe", config=config)
    model.config.use_cache = False
    torch.manual_seed(1)
    model = trainable_model(model, job.lora, job.training, job_placement(model.config.to_dict(), layout, job.lora))
    module = stage_module(model, stage_bounds(config.num_hidden_layers, STAGES), place.stage)
    groups = StageGroups(layout, rank)
    engine, _ = build_engine(module, job.training, layout, WORLD, steps + 1, bf16=False, groups=groups)
    stage = EngineStage(engine, place.stage, STAGES, torch.device("cpu"), group=groups.model)
    micro_batches = GLOBAL_BATCH // replicas

    def step(n: int) -> None:
        schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=token_loss_sum, scale_grads=False)
        rows = _rows(n, micro_batches, place.data_rank * micro_batches, seq, config.vocab_size)
        if place.stage == 0:
            schedule.step(rows)
        else:
            schedule.step(target=rows)
        stage.step()

    return _timed(step, steps)


def _worker(rank: int, world: int, layout: str, seq: int, steps: int, out_file: str) -> None:
    """One layout in fresh processes (DeepSpeed's expert groups are made once a process), after the estimate's
    inputs measured on the same ranks."""
    from moetune.workers.engine.deepspeed import init_comm

    init_comm()
    measured = {"matmul_rate": _matmul_rate(), "gather_rate": _gather_rate()}
    measured[layout] = (_zero3_seconds if layout == "zero3" else _pipeline_seconds)(rank, seq, steps)
    if rank == 0:
        torch.save(measured, out_file)


def _estimates(seq: int, matmul_rate: float, gather_rate: float) -> dict[str, float]:
    from moetune.api.plans import ClusterSpec
    from moetune.workers.planner.memory import Layout
    from moetune.workers.planner.model import model_facts
    from moetune.workers.planner.timing import estimate

    zero3, _, staged = _jobs(2)
    zero3 = zero3.model_copy(update={"training": zero3.training.model_copy(update={"seq_len": seq})})
    facts = model_facts(_config().to_dict(), zero3, torch.float32, "cpu")
    link = f"{gather_rate * 8:.0f}"
    cluster = ClusterSpec(nodes=1, gpus_per_node=WORLD, gpu_memory=64, gpu_tflops=matmul_rate / 1e12,
                          efficiency=1.0, nvlink=link, network=link, overlap=False)
    return {name: estimate(facts, Layout(dims, False, 1), cluster, GLOBAL_BATCH).step_seconds
            for name, dims in (("zero3", zero3.parallelism), ("pp2", staged))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    measured, inputs = {}, []
    with tempfile.TemporaryDirectory() as folder:
        for layout, name in (("zero3", f"ZeRO-3 x EP={EP}"), ("pp2", f"PP={STAGES} x EP={EP} (ZeRO-2)")):
            print(f"running {name} on {WORLD} gloo ranks, {args.steps} timed steps of {GLOBAL_BATCH} rows x "
                  f"{args.seq} tokens", flush=True)
            out_file = os.path.join(folder, f"{layout}.pt")
            launch(_worker, WORLD, layout, args.seq, args.steps, out_file)
            run = torch.load(out_file)
            measured[layout] = run[layout]
            inputs.append(run)
    # the estimate's inputs: the two launches' mean
    measured["matmul_rate"], measured["gather_rate"] = (sum(run[key] for run in inputs) / len(inputs)
                                                        for key in ("matmul_rate", "gather_rate"))
    estimated = _estimates(args.seq, measured["matmul_rate"], measured["gather_rate"])
    print(f"measured on this CPU: matmul {measured['matmul_rate'] / 1e9:.1f} GFLOP/s a rank (four at once), "
          f"all-gather {measured['gather_rate'] / 1e6:.0f} MB/s a rank")
    for name in ("zero3", "pp2"):
        print(f"{name}: measured {measured[name]:.2f} s a step, estimated {estimated[name]:.2f} s "
              f"({estimated[name] / measured[name]:.2f}x)")
    ratio, estimate_ratio = measured["pp2"] / measured["zero3"], estimated["pp2"] / estimated["zero3"]
    print(f"RESULT pp2_vs_zero3_step_ratio={ratio:.2f} estimate_ratio={estimate_ratio:.2f} "
          f"ranking_agrees={(ratio > 1) == (estimate_ratio > 1)} "
          f"zero3_estimate_ratio={estimated['zero3'] / measured['zero3']:.2f} "
          f"pp2_estimate_ratio={estimated['pp2'] / measured['pp2']:.2f}")


if __name__ == "__main__":
    main()
