"""The planner's answer for Kimi K3 as released (examples/kimi-k3/config.json: MXFP4 routed experts, bf16 the rest)
with the seed recipe (examples/kimi-k3.job.yaml), on 64 H200s and 64 B200s (140 and 179 GiB: their memory as the
device reports it, nvidia-smi's 143,771 and 183,359 MiB; sold as 141 and 192 GB), at 4K, 32K and 128K tokens: the
recommended layout and the fewest GPUs any layout fits on, per GPU in training and at load. Prints docs/parallelism.md's table
(markdown) and a RESULT line. The model facts are measured once per length (the meta-device pass is the cost; the
clusters share it).

    python bench/k3_plan.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.api.plans import PlannedLayout, parse_cluster
from moetune.workers.planner import plan
from moetune.workers.planner.model import model_facts

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CLUSTERS = {"H200": "nodes=8,gpus_per_node=8,gpu_memory=140GiB,nic=400Gbps",
            "B200": "nodes=8,gpus_per_node=8,gpu_memory=179GiB,nic=400Gbps"}
SEQ_LENS = (4096, 32768, 131072)
GIB = 2**30


def _layout(fit: PlannedLayout | None) -> str:
    if fit is None:
        return "none fits"
    par, ckpt = fit.parallelism, "on" if fit.activation_checkpointing else "off"
    return (f"{par.num_workers} GPUs, EP={par.expert_parallel_size}, ZeRO-{par.zero_stage}, checkpointing "
            f"{ckpt}: {fit.total_bytes / GIB:.1f} GiB, {fit.load_total_bytes / GIB:.1f} GiB at load")


def main() -> None:
    config = json.loads((EXAMPLES / "kimi-k3" / "config.json").read_text())
    request = yaml.safe_load((EXAMPLES / "kimi-k3.job.yaml").read_text())
    rows, result = [], {}
    for seq_len in SEQ_LENS:
        spec = JobCreate.model_validate({**request, "training": {**request["training"], "seq_len": seq_len}})
        job, choose = resolve_run_config(spec, 0), spec.training.activation_checkpointing == "auto"
        start = time.perf_counter()
        facts = model_facts(config, job)
        print(f"seq_len {seq_len:,}: model facts in {time.perf_counter() - start:.0f} s", flush=True)
        for gpu, cluster in CLUSTERS.items():
            p = plan(config, job, parse_cluster(cluster), choose, facts)
            rows.append(f"| {gpu} | {seq_len // 1024}K | {_layout(p.recommended)} | {_layout(p.fewest_gpus)} |")
            key = f"{gpu.lower()}_{seq_len // 1024}k_fewest_gpus"
            result[key] = p.fewest_gpus.parallelism.num_workers if p.fewest_gpus else 0
    print(f"\nkimi_k3, {facts.parameters:,} parameters; usable = 90 % of a GPU\n")
    print("| GPU | seq_len | recommended (64 GPUs) | fewest GPUs |\n|---|---|---|---|")
    print("\n".join(rows))
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
