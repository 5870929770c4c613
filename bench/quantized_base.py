"""Quantized frozen bases: the same tiny-but-wide MoE (DeepSeek-V3 architecture, routed experts ~98 % of the weights,
about Kimi-K2's share) as bf16, FP8-block and INT4 pack-quantized checkpoints on the local S3-compatible server,
streamed and trained by two gloo ranks with EP=2 (expert LoRA, ZeRO-2, bf16 compute on CPU), one format after
the other in the same run.

Per format and rank: frozen-weight bytes resident (dense parameters + quantized buffers) over the bf16 figure,
bytes streamed from storage over the rank's share of that checkpoint, and the LoRA step time over bf16's.
Last line: `RESULT fp8_resident_ratio=... int4_resident_ratio=... fp8_step_ratio=... int4_step_ratio=...
bytes_ratio=...` (bytes_ratio: the worst over formats and ranks).

    python bench/quantized_base.py [--steps 4] [--micro 4] [--seq 128]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support

import torch

from bench.step_args import step_arguments
from bench.support.tiny_models import batch
from bench.support.quantized import quantize_checkpoint
from bench.support.harness import launch

FORMATS = ("bf16", "fp8", "int4")
WIDE = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 512, "n_routed_experts": 128,
        "num_experts_per_tok": 2, "num_hidden_layers": 3, "first_k_dense_replace": 1, "q_lora_rank": 64,
        "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32}


def _checkpoints(work: str, s3_url: str) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    from moetune.api import storage
    from moetune.workers.families import REGISTRY

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(REGISTRY["deepseek_v3"].tiny_config(**WIDE), dtype=torch.bfloat16)
    dense = os.path.join(work, "bf16")
    model.save_pretrained(dense, max_shard_size="4MB")
    local = {"bf16": dense, **{f: quantize_checkpoint(dense, os.path.join(work, f), f, fp8_block=(128, 128))
                               for f in FORMATS[1:]}}
    storage.make_bucket("s3://bench", endpoint_url=s3_url)
    for fmt, path in local.items():
        storage.upload_dir(path, f"s3://bench/{fmt}", endpoint_url=s3_url)
    return {fmt: f"s3://bench/{fmt}" for fmt in FORMATS}


def _rank(rank: int, world: int, uris: dict, args, out_dir: str) -> None:
    from moetune.api import storage
    from moetune.api.models.job_create import JobCreate
    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.model import trainable_model
    from moetune.workers.experts.placement import job_placement
    from moetune.workers.weights.loader import stream_model

    job = JobCreate(model="s3://bench/x", training_file="s3://bench/x.jsonl",
                    lora={"rank": 8, "alpha": 16, "dropout": 0.0, "train_experts": True},
                    training={"max_steps": 100, "global_batch_size": args.micro * world,
                              "micro_batch_size": args.micro, "seq_len": args.seq},
                    parallelism={"num_workers": world, "expert_parallel_size": world, "zero_stage": 2})
    results = {}
    for fmt, uri in uris.items():
        config = json.loads(storage.read_text(f"{uri}/config.json"))
        placement = job_placement(config, job.parallelism, job.lora)
        streamed = stream_model(uri, torch.device("cpu"), torch.bfloat16, placement, cache_dir="")
        model = streamed.model
        persistent = model.state_dict(keep_vars=True)
        resident = streamed.quantized_bytes + sum(p.nbytes for p in model.parameters()) + sum(
            b.nbytes for n, b in model.named_buffers() if n in persistent)
        torch.manual_seed(1)
        model = trainable_model(model, job.lora, job.training, placement)
        engine, _ = build_engine(model, job.training, job.parallelism, world, 100, bf16=False)
        times = []
        for step in range(args.warmup + args.steps):
            started = time.perf_counter()
            loss = engine(**batch(rank, step, args.micro, args.seq, vocab=272)).loss
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - started)
        frozen = resident - sum(p.nbytes for p in engine.module.parameters() if p.requires_grad)
        results[fmt] = {"resident": frozen, "streamed": streamed.stats.bytes_from_storage,
                        "needed": streamed.stats.bytes_needed, "step_s": sum(times[args.warmup:]) / args.steps}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def main() -> None:
    from moetune.service.local.embedded import local_s3_server, s3_env

    args = step_arguments(__doc__, steps=4, warmup=1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as work, local_s3_server() as s3_url:
        os.environ.update(s3_env(s3_url))
        uris = _checkpoints(work, s3_url)
        launch(_rank, 2, uris, args, work)
        ranks = [json.load(open(os.path.join(work, f"rank{r}.json"))) for r in range(2)]
    print(f"tiny-wide DeepSeek-V3 MoE, EP=2 over 2 gloo ranks, bf16 compute, {args.micro}x{args.seq} tokens per rank "
          f"and step, {args.steps} timed steps")
    print(f"{'format':6s} {'rank':>4s} {'resident MiB':>12s} {'vs bf16':>8s} {'streamed/share':>14s} "
          f"{'step ms':>8s} {'vs bf16':>8s}")
    ratios = {}
    for fmt in FORMATS:
        for r, results in enumerate(ranks):
            got, bf16 = results[fmt], results["bf16"]
            ratios[(fmt, r)] = (got["resident"] / bf16["resident"], got["streamed"] / got["needed"],
                                got["step_s"] / bf16["step_s"])
            print(f"{fmt:6s} {r:4d} {got['resident'] / 2**20:12.2f} {ratios[(fmt, r)][0]:8.3f} "
                  f"{ratios[(fmt, r)][1]:14.3f} {got['step_s'] * 1e3:8.1f} {ratios[(fmt, r)][2]:8.2f}")
    worst = {fmt: [max(ratios[(fmt, r)][i] for r in range(2)) for i in range(3)] for fmt in FORMATS}
    bytes_ratio = max(worst[fmt][1] for fmt in FORMATS)
    print(f"RESULT fp8_resident_ratio={worst['fp8'][0]:.3f} int4_resident_ratio={worst['int4'][0]:.3f} "
          f"fp8_step_ratio={worst['fp8'][2]:.2f} int4_step_ratio={worst['int4'][2]:.2f} bytes_ratio={bytes_ratio:.3f}")


if __name__ == "__main__":
    main()
