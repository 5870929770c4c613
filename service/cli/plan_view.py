"""A plan (api.plans.Plan) as the CLI shows it: one table of per-GPU bytes, a column per layout."""

from __future__ import annotations

from rich.table import Table

from moetune.api.plans import Plan, PlannedLayout

_ROWS = (("lora_parameters", "LoRA parameters"), ("lora_gradients", "LoRA gradients"),
         ("optimizer_state", "optimizer state (fp32 master + Adam)"), ("activations", "activations (saved)"),
         ("logits", "loss (logits)"), ("loss_chunk", "loss chunk (transient)"), ("all_to_all", "all-to-all buffers"),
         ("zero_buckets", "ZeRO buckets"), ("zero3_gather", "ZeRO-3 gathered layer"),
         ("cuda_context", "CUDA context, NCCL (stated)"))


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _heading(name: str, fit: PlannedLayout) -> str:
    par, checkpointing = fit.parallelism, "on" if fit.activation_checkpointing else "off"
    context = f", CP={par.context_parallel_size}" if par.context_parallel_size > 1 else ""
    return (f"{name}\n{par.num_workers} GPUs, EP={par.expert_parallel_size}{context}, ZeRO-{par.zero_stage}\n"
            f"checkpointing {checkpointing}, micro-batch {fit.micro_batch_size}")


def plan_table(plan: Plan) -> Table:
    layouts = [(name, fit) for name, fit in (("as submitted", plan.submitted), ("recommended", plan.recommended),
                                             ("fewest GPUs", plan.fewest_gpus)) if fit]
    model = plan.model
    table = Table("per GPU", *(_heading(name, fit) for name, fit in layouts),
                  title=f"{model.model_type}, {model.parameters:,} parameters, {model.routed_experts} "
                        f"experts (top-{model.experts_per_token}), seq_len {plan.seq_len:,}")
    labels = sorted({label for _, fit in layouts for label in fit.bytes["frozen_weights"]})
    for label in labels:
        table.add_row(f"frozen weights ({label})", *(_gib(fit.bytes["frozen_weights"].get(label, 0))
                                                    for _, fit in layouts))
    for key, title in _ROWS:
        table.add_row(title, *(_gib(fit.bytes[key]) for _, fit in layouts))
    table.add_row("total", *(f"[bold]{_gib(fit.total_bytes)}[/]" for _, fit in layouts))
    table.add_row("fits", *("yes" if fit.fits else "[red]no[/]" for _, fit in layouts))
    return table


def plan_summary(plan: Plan) -> list[str]:
    usable, load = plan.cluster.usable_bytes_per_gpu, plan.load
    per_token = plan.activation_bytes_per_token
    gpu = plan.cluster.gpu_memory
    lines = [f"GPU memory: {_gib(gpu)} (--cluster gpu_memory takes GiB, as the device reports memory; GB means "
             "10^9 bytes)",
             f"usable per GPU: {_gib(usable)}; activations per token: {per_token['without_checkpointing']:,.0f} B "
             f"without checkpointing, {per_token['with_checkpointing']:,.0f} B with; "
             f"logits {per_token['logits']:,.0f} B",
             f"load: {load.bytes_per_rank / 1e9:,.1f} GB per rank, {load.bytes_per_node / 1e9:,.1f} GB per node "
             f"at EP={load.expert_parallel_size}: about {load.seconds:,.0f} s over the node's NIC"]
    if plan.recommended:
        lines.append(f"tuner starts at micro-batch {plan.recommended.tuner_start_micro_batch}")
    else:
        lines.append(f"[red]no layout of {plan.submitted.parallelism.num_workers} workers fits[/]")
    return lines
