"""Two real processes on loopback gloo, and the plain single-process transformers + PEFT reference (the EP
benchmarks and tests/workers/experts run the same cases)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import RunConfig, resolve_run_config
from moetune.service.local.embedded import free_port
from bench.support.tiny_models import batch, plain_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[2]  # the repository root, where spawned ranks import bench.support

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0}
SAVE_AFTER, STEPS = 2, 4  # checkpoint tests: save after step 2 of 4


def spec(ep: int, zero: int, train_experts: bool = False, world: int = 2, steps: int = 1, micro: int | str = 2,
         lr: float = 1e-2, targets="all-linear", kernels: bool = True, checkpointing: bool = False,
         global_batch: int | None = None, cp: int = 1) -> RunConfig:
    """The run config of a harness job (its model built in memory, its batches made here); global_batch:
    micro * world by default."""
    request = JobCreate(model="file:///unused", training_file="file:///unused",
                        lora={**LORA, "train_experts": train_experts, "target_modules": targets},
                        training={"max_steps": steps, "global_batch_size": global_batch or micro * world,
                                  "micro_batch_size": micro,
                                  "learning_rate": lr, "warmup_ratio": 0.0, "lr_scheduler": "constant",
                                  "custom_kernels": kernels, "activation_checkpointing": checkpointing},
                        parallelism={"num_workers": world, "expert_parallel_size": ep, "zero_stage": zero,
                                     "context_parallel_size": cp})
    return resolve_run_config(request, seed=0)


def _entry(rank: int, world: int, port: int, fn, args):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # Done: skip the interpreter's teardown, where a C++ thread left by gloo or DeepSpeed's shm op can abort the
    # process ("terminate called without an active exception", seen once after every case had written its
    # results). That teardown is not under test; a failure inside `fn` still raises above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn, world: int, *args) -> None:
    """Runs fn(rank, world, *args) in `world` fresh processes; raises if any fails."""
    root = str(REPO)
    if root not in sys.path:  # spawned children start from this sys.path and import `bench.support.harness`
        sys.path.append(root)
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="spawn")


def expert_bytes(model) -> int:
    """Bytes of routed-expert base weights this rank stores (its ZeRO-3 partition where partitioned; a quantized
    base's packed tensors)."""
    from moetune.workers.experts.module import ExpertParallelExperts

    total = 0
    for module in model.modules():
        if isinstance(module, ExpertParallelExperts) and module.quantized:
            total += sum(t.nbytes for weight in module.base_weights() for t in weight.tensors().values())
        elif isinstance(module, ExpertParallelExperts):
            for p in (p for name, p in module.named_parameters() if not name.startswith("lora_")):
                stored = getattr(p, "ds_tensor", p)
                total += stored.numel() * stored.element_size()
    return total


def write_released_checkpoint(folder: str, family_name: str) -> str:
    """The family's tiny random model (plain_model) saved in its released format (Family.as_released: Kimi K3's
    per-expert mxfp4-pack-quantized experts, bf16 elsewhere; transformers' own without one). Returns the folder."""
    from moetune.workers.families import REGISTRY

    family = REGISTRY[family_name]
    plain_model(family).save_pretrained(folder, max_shard_size="100KB")  # sharded: as_released rewrites the index
    if family.as_released is not None:
        family.as_released(folder)
    return folder


def base_model(source: str, skew: bool = False, config=None, job: RunConfig | None = None, held=None):
    """A family's tiny random model (`source` a family name; plain_model), or the checkpoint in the folder `source`
    streamed as a job streams it: with `job`, this rank's experts of its placement kept in their stored format and
    the family's kernel swaps where the job asks for them (the engine); without, every expert dequantized to fp32
    and the stock modules (the one-process reference). `held`: only these tensors are loaded (stream_model's)."""
    import json

    from moetune.workers.experts.placement import job_placement
    from moetune.workers.families import REGISTRY, family_for
    from moetune.workers.weights.loader import stream_model

    if source in REGISTRY:
        return plain_model(REGISTRY[source], skew_to_first_half=skew, config=config)
    uri, cpu = f"file://{source}", torch.device("cpu")
    if job is None:
        return stream_model(uri, cpu, torch.float32, cache_dir="", base_weights="dequantized").model.train()
    with open(os.path.join(source, "config.json")) as f:
        checkpoint_config = json.load(f)
    placement = job_placement(checkpoint_config, job.parallelism, job.lora)
    model = stream_model(uri, cpu, torch.float32, placement, cache_dir="", held=held).model.train()
    if job.training.custom_kernels:
        family_for(checkpoint_config).apply_kernel_swaps(model)
    return model


def wide_config(family_name: str):
    """The tiny config with experts wide enough that ZeRO-3 frees them after their forward, as every real model's
    (DeepSpeed keeps tensors of up to 1e5 elements gathered: the tiny model's experts all stay)."""
    from moetune.workers.families import REGISTRY

    return REGISTRY[family_name].tiny_config(moe_intermediate_size=512)


def make_engine(rank: int, world: int, family_name: str, job: RunConfig, skew: bool = False, config=None,
                method=None):
    """The moetune engine of this rank, built exactly as a job builds it (same seeds on every rank).
    `family_name`: or a checkpoint folder (base_model). With a training `method`, the family's kernel swaps go in
    first and the method prepares the model before the engine wraps it, as a job's worker does."""
    from moetune.workers.engine.deepspeed import build_engine
    from moetune.workers.families import family_for
    from moetune.workers.model import trainable_model
    from moetune.workers.experts.placement import job_placement

    model = base_model(family_name, skew, config, job)
    if method is not None:
        family_for(model.config).apply_kernel_swaps(model)
    torch.manual_seed(1)
    placement = job_placement(model.config.to_dict(), job.parallelism, job.lora)
    model = trainable_model(model, job.lora, job.training, placement)
    if method is not None:
        method.prepare(model)
    engine, _ = build_engine(model, job.training, job.parallelism, world, job.training.max_steps, bf16=False)
    return engine


def train_step(engine, rank: int, step: int, grads: dict | None = None) -> float:
    """`grads`: filled with every trainable parameter's full gradient of this step."""
    from deepspeed.utils import safe_get_full_grad

    loss = engine(**batch(rank, step)).loss
    engine.backward(loss)
    if grads is not None:
        grads.update({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()
                      if p.requires_grad})
    engine.step()
    return loss.item()


def run_cases(rank: int, world: int, cases: list[tuple[str, str, str, str, bool]], out_dir: str) -> None:
    """Several (case id, runner name, family, spec JSON, skew) runs one after another in the same processes
    (one start for all); the runner is `run_engine`, `run_and_resume`, or the image and builder runs (their
    "family" is a checkpoint's folder; an image run's `skew` means rank 1's micro-batch has no image)."""
    from bench.support.builder_step import builder_step
    from bench.support.export_check import export_round_trip
    from bench.support.image_batches import run_image_ep

    runners = {"train": run_engine, "resume": run_and_resume, "saved": run_saved_experts,
               "tuner_start": run_tuner_start,
               "builder": lambda rank, world, model_dir, spec_json, out, _: builder_step(rank, world, model_dir,
                                                                                          spec_json, out),
               "export": lambda rank, world, family_name, spec_json, out, _: export_round_trip(rank, world, out),
               "image": lambda rank, world, model_dir, spec_json, out, rank1_text_only: run_image_ep(
                   rank, world, model_dir, spec_json, out, 1 if rank1_text_only else None)}
    for case_id, runner, family_name, spec_json, skew in cases:
        runners[runner](rank, world, family_name, spec_json, os.path.join(out_dir, case_id), skew)


def run_engine(rank: int, world: int, family_name: str, spec_json: str, out_dir: str, skew: bool = False) -> None:
    """The moetune engine on this rank: per-step loss, first-step full LoRA gradients and expert-load count, expert
    bytes."""
    from deepspeed.utils import safe_get_full_grad

    from moetune.workers.reporting.expert_load import ExpertLoad

    job = RunConfig.model_validate_json(spec_json)
    os.makedirs(out_dir, exist_ok=True)
    engine = make_engine(rank, world, family_name, job, skew)
    load = ExpertLoad(engine.module)
    losses, grads = [], {}
    for step in range(job.training.max_steps):
        loss = engine(**batch(rank, step, job.training.micro_batch_size)).loss
        engine.backward(loss)
        if step == 0:
            grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}
            load_first_step = float(load.totals[0].sum())  # assignments the metrics counted (a rerun must not)
        engine.step()
        losses.append(loss.item())
    routed = sum(m.tokens_per_expert for m in engine.module.modules() if hasattr(m, "tokens_per_expert"))
    row_bytes = {m.comm.row_bytes for m in engine.module.modules() if hasattr(m, "comm")}  # token width exchanged
    torch.save({"losses": losses, "grads": grads, "expert_bytes": expert_bytes(engine.module), "routed": routed,
                "load_first_step": load_first_step,
                "a2a_row_bytes": row_bytes}, os.path.join(out_dir, f"rank{rank}.pt"))


def run_saved_experts(rank: int, world: int, family_name: str, spec_json: str, out_dir: str, skew: bool = False):
    """One step of the wide-expert model (wide_config) under ZeRO-3: the bytes that the tensors autograd saved in
    the forward still hold of gathered frozen expert weights once the forward is done (accounted through
    saved-tensor hooks: a saved tensor sharing storage with a gathered expert weight when it is saved), whether
    DeepSpeed released those weights, and the first step's loss and full LoRA gradients."""
    from deepspeed.utils import safe_get_full_grad

    from moetune.workers.experts.module import ExpertParallelExperts

    job = RunConfig.model_validate_json(spec_json)
    engine = make_engine(rank, world, family_name, job, skew, wide_config(family_name))
    frozen = [p for m in engine.module.modules() if isinstance(m, ExpertParallelExperts)
              for name, p in m.named_parameters() if not name.startswith("lora_")]
    kept = []

    def pack(t):
        gathered = {p.untyped_storage().data_ptr() for p in frozen if p.numel()}
        if t.untyped_storage().data_ptr() in gathered:
            kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(**batch(rank, 0, job.training.micro_batch_size)).loss
    held = sum(t.untyped_storage().nbytes() for t in kept)
    released = all(p.numel() == 0 for p in frozen)
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"losses": [loss.item()], "grads": grads, "saved_expert_tensors": len(kept),
                "saved_expert_bytes_after_forward": held, "released": released},
               os.path.join(out_dir, f"rank{rank}.pt"))


def run_tuner_start(rank: int, world: int, family_name: str, spec_json: str, out_dir: str, skew: bool = False):
    """The job's step runner with micro_batch_size "auto" on ranks with different memory: rank 0's budget would
    start it at the whole per-rank batch, the others' at 2. Records the size each rank planned for itself and the
    one it starts at (its own and DeepSpeed's view)."""
    from moetune.workers.loop.collectives import Collectives
    from moetune.workers.loop.step import RankPlace, StepRunner
    from moetune.workers.loop.tuner import MicroBatchTuner
    from moetune.workers.planner.start import sequence_bytes

    job = RunConfig.model_validate_json(spec_json)
    engine = make_engine(rank, world, family_name, job, skew)
    per_rank = job.training.global_batch_size // world
    sequences = per_rank + 0.5 if rank == 0 else 2.5
    budget_mb = sequences * sequence_bytes(engine.module, job) / 1e6
    job = job.model_copy(update={"training": job.training.model_copy(update={"memory_budget_mb": budget_mb})})
    cpu = torch.device("cpu")
    own = MicroBatchTuner.planned(engine.module, per_rank, job, budget_mb * 1e6, cpu).size
    runner = StepRunner(engine, None, job, RankPlace(rank, world, 0, cpu), Collectives(cpu),
                        lambda *args, **kwargs: None, total_steps=1)
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"own": own, "start": runner.micro_batch_size, "deepspeed": engine.train_micro_batch_size_per_gpu()},
               os.path.join(out_dir, f"rank{rank}.pt"))


def run_and_resume(rank: int, world: int, family_name: str, spec_json: str, out_dir: str, skew: bool = False) -> None:
    """Trains STEPS steps with a checkpoint after SAVE_AFTER, exports the adapter, then resumes a fresh engine
    from the checkpoint and trains the remaining steps again. Records the first step's gradients and the expert
    bytes too (run_engine's), so that a resume case also checks the curve."""
    from moetune.workers.checkpoints.save import load_checkpoint, save_adapter, save_checkpoint

    job = RunConfig.model_validate_json(spec_json)
    ckpt, adapter = os.path.join(out_dir, "ckpt"), os.path.join(out_dir, "adapter")
    engine = make_engine(rank, world, family_name, job, skew)
    losses, grads = [], {}
    for step in range(STEPS):
        losses.append(train_step(engine, rank, step, grads if step == 0 else None))
        if step + 1 == SAVE_AFTER:
            save_checkpoint(engine, ckpt, is_writer=rank == 0)
    save_adapter(engine, adapter, is_writer=rank == 0)
    engine.eval()
    with torch.no_grad():
        logits = engine(**batch(rank, step=99)).logits

    resumed_engine = make_engine(rank, world, family_name, job, skew)
    load_checkpoint(resumed_engine, ckpt)
    resumed = [train_step(resumed_engine, rank, step) for step in range(SAVE_AFTER, STEPS)]
    torch.save({"losses": losses, "resumed": resumed, "logits": logits, "grads": grads,
                "expert_bytes": expert_bytes(engine.module)}, os.path.join(out_dir, f"rank{rank}.pt"))


def _with_expert_lora(peft_model, fam, job: RunConfig, source: str, skew: bool, model_config=None):
    """The same adapter as PEFT sees it: linear LoRA plus `target_parameters` LoRA on the fused experts, with the
    expert A drawn exactly as the engine draws them (B = 0)."""
    from peft import (
        LoraConfig,
        get_peft_model,
        get_peft_model_state_dict,
        set_peft_model_state_dict,
    )

    from moetune.workers.families.spec import in_proj_name
    from moetune.workers.experts.lora_layout import peft_expert_state, target_parameters
    from moetune.workers.experts.module import init_expert_lora_a
    from moetune.workers.lora.peft_lora import _no_v4_target_conversion

    state = get_peft_model_state_dict(peft_model)
    r = job.lora.rank
    for name, block in fam.moe_blocks(peft_model.base_model.model):
        experts = getattr(block, fam.experts)
        in_proj = in_proj_name(experts)  # gate_up_proj, or up_proj (nemotron_h: no gate)
        first, transposed = getattr(experts, in_proj), getattr(experts, "is_transposed", False)
        e, two_i, hidden = first.shape
        if transposed:  # stored [E, in, out] (gpt-oss)
            hidden, two_i = two_i, hidden
        intermediate = experts.down_proj.shape[1 if transposed else 2]
        a_gate_up, a_down = init_expert_lora_a(range(e), r, hidden, intermediate, first.dtype, first.device)
        factors = {"lora_gate_up_a": a_gate_up, "lora_down_a": a_down,
                   "lora_gate_up_b": torch.zeros(e, two_i, r), "lora_down_b": torch.zeros(e, hidden, r)}
        state.update(peft_expert_state(f"base_model.model.{name}.{fam.experts}", factors))
    old = peft_model.peft_config["default"]
    config = LoraConfig(r=r, lora_alpha=old.lora_alpha, lora_dropout=0.0, target_modules=old.target_modules,
                        target_parameters=target_parameters(in_proj))
    model = base_model(source, skew, model_config)
    with _no_v4_target_conversion(model):
        reference_model = get_peft_model(model, config)
    assert not set_peft_model_state_dict(reference_model, state).unexpected_keys
    return reference_model


def expert_grads_in_engine_layout(peft_model, fam) -> dict:
    """Copies of the reference gradients of the PEFT expert LoRA, as full (E, ...) stacks under the engine's parameter
    names (the layout change makes views, which gradient clipping would scale in place)."""
    from moetune.workers.experts.lora_layout import factors_from_peft

    grads = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if p.grad is not None}
    out = {}
    for name, block in fam.moe_blocks(peft_model.base_model.model):
        key = f"base_model.model.{name}.{fam.experts}"
        num_experts = getattr(block, fam.experts).num_experts
        out.update({f"{key}.{k}": v.clone() for k, v in factors_from_peft(key, grads, num_experts).items()})
    return out


def reference(family_name: str, job: RunConfig, world: int, skew: bool = False, micro: int = 2,
              config=None) -> dict:
    """Plain transformers + PEFT in one process: the same batches, DeepSpeed's rank-mean loss, AdamW, clipping.
    `family_name`: or a checkpoint folder (base_model: dequantized); `config`: another config of the family (the
    tiny one by default)."""
    from moetune.workers.families import family_for
    from moetune.workers.lora.peft_lora import apply_lora

    model = base_model(family_name, skew, config)
    fam = family_for(model.config)
    torch.manual_seed(1)
    peft_model = apply_lora(model, job.lora)
    if job.lora.train_experts:
        peft_model = _with_expert_lora(peft_model, fam, job, family_name, skew, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=job.training.learning_rate, weight_decay=0.0)
    losses, grads = [], {}
    for step in range(job.training.max_steps):
        loss = sum(peft_model(**batch(r, step, micro)).loss for r in range(world)) / world
        loss.backward()
        if step == 0:
            # no gradient reaches LoRA on glm5_next's DSA indexer (it only picks top-k positions): zeros in DeepSpeed
            grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                     for n, p in peft_model.named_parameters() if p.requires_grad and ".experts." not in n}
            if job.lora.train_experts:
                grads.update(expert_grads_in_engine_layout(peft_model, fam))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    full_expert_bytes = sum(p.numel() * p.element_size() for _, block in fam.moe_blocks(model)
                            for p in getattr(block, fam.experts).parameters())
    return {"losses": losses, "grads": grads, "expert_bytes": full_expert_bytes}
