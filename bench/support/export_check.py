"""The exported adapter's expert LoRA, bit for bit the ranks' own factors at EP > 1: each rank trains one step of the
tiny qwen3_moe with expert LoRA (so that B is no longer 0), keeps its own experts' factors, and the chief writes the
adapter, whose expert tensors reach it by gather from every EP rank (workers.experts.shards). A receive buffer that
NCCL fills as if dense while it is strided scrambles every rank's but the chief's B (gloo copies correctly: the CPU
suite's collectives refuse such buffers, workers.comm.checked)."""

from __future__ import annotations

import os

import torch

FAMILY = "qwen3_moe"


def export_round_trip(rank: int, world: int, out_dir: str, device=None) -> None:
    """This rank's part: one step, its own expert factors saved, the adapter written (a collective)."""
    from moetune.workers.checkpoints.save import save_adapter
    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.experts.placement import job_placement
    from moetune.workers.experts.shards import expert_modules
    from moetune.workers.model import trainable_model
    from bench.support.harness import base_model, spec
    from bench.support.tiny_models import batch

    device = device or torch.device("cpu")
    job = spec(ep=world, zero=2, train_experts=True, world=world)
    model = base_model(FAMILY).to(device)
    torch.manual_seed(1)
    model = trainable_model(model, job.lora, job.training, job_placement(model.config.to_dict(), job.parallelism,
                                                                         job.lora))
    engine, _ = build_engine(model, job.training, job.parallelism, world, 1, bf16=False)
    loss = engine(**{k: v.to(device) for k, v in batch(rank, 0).items()}).loss
    engine.backward(loss)
    engine.step()
    own = {f"{name}.{factor}": p.detach().cpu().clone() for name, module in expert_modules(engine.module)
           for factor, p in module.named_parameters(recurse=False) if factor.startswith("lora_")}
    first = {name: module.ep.local.start for name, module in expert_modules(engine.module)}
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"own": own, "first": first}, os.path.join(out_dir, f"rank{rank}.pt"))
    save_adapter(engine, os.path.join(out_dir, "adapter"), is_writer=rank == 0)


def export_mismatches(out_dir: str, world: int) -> list[str]:
    """Each rank's expert factors against the exported adapter's slice for its experts: the names that differ (any
    bit), or that no adapter entry holds."""
    from safetensors.torch import load_file

    from moetune.workers.experts.lora_layout import factors_from_peft

    written = load_file(os.path.join(out_dir, "adapter", "adapter_model.safetensors"))
    wrong = []
    for rank in range(world):
        saved = torch.load(os.path.join(out_dir, f"rank{rank}.pt"))
        for name, start in saved["first"].items():
            local = {k.rpartition(".")[2]: v for k, v in saved["own"].items() if k.rpartition(".")[0] == name}
            count = next(iter(local.values())).shape[0]
            exported = factors_from_peft(name, written, count * world)
            wrong += [f"rank {rank} {name}.{factor}" for factor, value in local.items()
                      if not torch.equal(exported[factor][start:start + count], value)]
    return wrong
