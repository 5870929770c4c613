"""The planner's answer for Kimi K3 as released (examples/kimi-k3/config.json: MXFP4 routed experts, bf16 the rest)
with the seed recipe (examples/kimi-k3.job.yaml), on up to 256 H200s and 256 B200s (32 nodes of 8; 140 and 179 GiB:
their memory as the device reports it, nvidia-smi's 143,771 and 183,359 MiB; sold as 141 and 192 GB), at 4K, 32K,
128K and 1M tokens: the recommended layout for the recipe's 64 workers and the fewest GPUs any layout fits on
(context parallelism included), per GPU in training and at load, and what the fewest layout's memory goes to; then
the estimated steps (workers.planner.timing) of the fastest layout of 64 GPUs that fits, pipeline stages included,
beside the fastest without stages (ZeRO only). Prints docs/parallelism.md's tables (markdown) and a RESULT line. The model facts are measured once per length (the
meta-device passes, one per context-parallel size a plan reaches, are the cost; the clusters share them).

    python bench/k3_plan.py [--lengths 4096,32768,131072,1048576]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import yaml

from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.api.plans import PlannedLayout, parse_cluster
from moetune.workers.planner import plan
from moetune.workers.planner.memory import Layout, breakdown, total
from moetune.workers.planner.model import model_facts

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# dense bf16 peaks and NVLink each way as stated for the SXM parts (the time estimates' inputs; 40 % of the peak)
CLUSTERS = {"H200": "nodes=32,gpus_per_node=8,gpu_memory=140GiB,nic=400Gbps,gpu_tflops=989,nvlink=450GB/s",
            "B200": "nodes=32,gpus_per_node=8,gpu_memory=179GiB,nic=400Gbps,gpu_tflops=2250,nvlink=900GB/s"}
SEQ_LENS = (4096, 32768, 131072, 1048576)
GIB = 2**30


def _layout(fit: PlannedLayout | None) -> str:
    if fit is None:
        return "none fits"
    par, ckpt = fit.parallelism, "on" if fit.activation_checkpointing else "off"
    stages = f"PP={par.pipeline_parallel_size}, " if par.pipeline_parallel_size > 1 else ""
    return (f"{par.num_workers} GPUs, EP={par.expert_parallel_size}, CP={par.context_parallel_size}, {stages}"
            f"ZeRO-{par.zero_stage}, checkpointing {ckpt}: {fit.total_bytes / GIB:.1f} GiB, "
            f"{fit.load_total_bytes / GIB:.1f} GiB at load")


def _parts(parts: dict) -> str:
    """Where a layout's memory goes: its largest parts in GiB."""
    parts = {k: sum(v.values()) if isinstance(v, dict) else v for k, v in parts.items()}
    return ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:4])


def _most_split(facts, job, gpus: int) -> str:
    """Where nothing fits: the breakdown of the most split layout on all the cluster's GPUs (its largest CP size,
    the largest EP dividing the experts, ZeRO-3, recomputation), with the largest layer's rerun, which the
    activations include."""
    ep = max(d for d in range(1, gpus + 1) if gpus % d == 0 and facts.num_experts % d == 0)
    cp = max(c for c in facts.context_sizes if gpus % c == 0)
    dims = job.parallelism.model_copy(update={"num_workers": gpus, "expert_parallel_size": ep,
                                              "context_parallel_size": cp, "zero_stage": 3})
    parts = breakdown(facts, Layout(dims, True, 1))
    rerun = max(facts.layer_bytes(ep, cp))
    return (f"at {gpus} GPUs, EP={ep}, CP={cp}, ZeRO-3, checkpointing on: {total(parts) / GIB:.1f} GiB "
            f"({_parts(parts)}; the largest layer's rerun {rerun / GIB:.1f} of the activations)")


def _speed(fit: PlannedLayout | None) -> str:
    if fit is None:
        return "none fits | –"
    par, t = fit.parallelism, fit.time
    split = "".join(f", {n}={v}" for n, v in (("CP", par.context_parallel_size), ("PP", par.pipeline_parallel_size))
                    if v > 1)
    bubble = f", bubble {t.bubble_fraction:.0%}" if t.bubble_fraction else ""
    return (f"EP={par.expert_parallel_size}{split}, ZeRO-{par.zero_stage}: step {t.step_seconds:,.1f} s{bubble} | "
            f"{t.tokens_per_second_per_gpu:,.0f}")


def _length(tokens: int) -> str:
    return f"{tokens // 2**20}M" if tokens % 2**20 == 0 else f"{tokens // 1024}K"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(map(str, SEQ_LENS)))
    lengths = [int(n) for n in parser.parse_args().lengths.split(",")]
    config = json.loads((EXAMPLES / "kimi-k3" / "config.json").read_text())
    request = yaml.safe_load((EXAMPLES / "kimi-k3.job.yaml").read_text())
    rows, speeds, result, why = [], [], {}, []
    for seq_len in lengths:
        spec = JobCreate.model_validate({**request, "training": {**request["training"], "seq_len": seq_len}})
        job, choose = resolve_run_config(spec, 0), spec.training.activation_checkpointing == "auto"
        start = time.perf_counter()
        facts = model_facts(config, job)
        one_block = replace(facts, stage_block=facts.num_layers)  # no stage split: the layouts without stages
        for gpu, cluster in CLUSTERS.items():
            p = plan(config, job, parse_cluster(cluster), choose, facts)
            rows.append(f"| {gpu} | {_length(seq_len)} | {_layout(p.recommended)} | {_layout(p.fewest_gpus)} |")
            fastest = p.tradeoffs[0] if p.tradeoffs else None
            unstaged = next(iter(plan(config, job, parse_cluster(cluster), choose, one_block).tradeoffs), None)
            speeds.append(f"| {gpu} | {_length(seq_len)} | {_speed(fastest)} | {_speed(unstaged)} |")
            for name, fit in (("fastest", fastest), ("zero_only", unstaged)):
                result[f"{gpu.lower()}_{_length(seq_len).lower()}_{name}_tokens_per_gpu"] = (
                    round(fit.time.tokens_per_second_per_gpu) if fit else 0)
            result[f"{gpu.lower()}_{_length(seq_len).lower()}_fewest_gpus"] = (
                p.fewest_gpus.parallelism.num_workers if p.fewest_gpus else 0)
            if p.fewest_gpus:
                why.append(f"{gpu} {_length(seq_len)}, fewest GPUs (GiB): {_parts(p.fewest_gpus.bytes)}")
            else:
                why.append(f"{gpu} {_length(seq_len)}: none fits within {p.cluster.usable_bytes_per_gpu / GIB:.1f} "
                           f"GiB; {_most_split(facts, job, p.cluster.gpus)}")
        print(f"seq_len {seq_len:,}: planned in {time.perf_counter() - start:.0f} s, the activations of CP sizes "
              f"{list(facts.measured_contexts)} measured", flush=True)
    print(f"\nkimi_k3, {facts.parameters:,} parameters; usable = 90 % of a GPU\n")
    print("| GPU | seq_len | recommended (64 GPUs) | fewest GPUs |\n|---|---|---|---|")
    print("\n".join(rows))
    print("\n" + "\n".join(why))
    print("\nEstimated steps on 64 GPUs (global batch 64; every figure an estimate: see the plan's assumptions)\n")
    print("| GPU | seq_len | fastest that fits | tokens/s/GPU | fastest without stages | tokens/s/GPU |\n"
          "|---|---|---|---|---|---|")
    print("\n".join(speeds))
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
