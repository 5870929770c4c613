"""A plan (api.plans.Plan) as the CLI shows it: one table of per-GPU bytes, a column per layout; the trade-off
table of the layouts that fit, fastest first, with their estimated step times; a summary."""

from __future__ import annotations

from rich.table import Table

from moetune.api.plans import Plan, PlannedLayout

_ROWS = (("lora_parameters", "LoRA parameters"), ("lora_gradients", "LoRA gradients"),
         ("optimizer_state", "optimizer state (fp32 master + Adam)"), ("activations", "activations (saved)"),
         ("logits", "loss (logits)"), ("loss_chunk", "loss chunk (transient)"), ("all_to_all", "all-to-all buffers"),
         ("zero_buckets", "ZeRO buckets"), ("zero3_gather", "ZeRO-3 gathered layer"),
         ("pipeline_buffers", "pipeline stage buffers"), ("cuda_context", "CUDA context, NCCL (stated)"))
# the step's time by kind, as the trade-off table names them (api.plans.PlannedTime.seconds)
_TIMES = (("compute", "compute"), ("zero3_gather", "ZeRO-3"), ("all_to_all", "a2a"),
          ("context_exchange", "CP"), ("pipeline_sends", "PP"))
TRADEOFF_ROWS = 8


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _shape(fit: PlannedLayout) -> str:
    par = fit.parallelism
    split = "".join(f", {name}={size}" for name, size in (("CP", par.context_parallel_size),
                                                         ("PP", par.pipeline_parallel_size)) if size > 1)
    return f"EP={par.expert_parallel_size}{split}, ZeRO-{par.zero_stage}"


def _heading(name: str, fit: PlannedLayout) -> str:
    checkpointing = "on" if fit.activation_checkpointing else "off"
    return (f"{name}\n{fit.parallelism.num_workers} GPUs, {_shape(fit)}\n"
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
        if any(key in fit.bytes for _, fit in layouts):
            table.add_row(title, *(_gib(fit.bytes.get(key, 0)) for _, fit in layouts))
    table.add_row("total", *(f"[bold]{_gib(fit.total_bytes)}[/]" for _, fit in layouts))
    table.add_row("fits", *("yes" if fit.fits else "[red]no[/]" for _, fit in layouts))
    return table


def tradeoff_table(plan: Plan) -> Table:
    """The layouts of the submitted workers that fit, fastest first: memory, estimated step time by kind, tokens
    per second per GPU."""
    cluster = plan.cluster
    table = Table("layout", "GiB", "step s", *(f"{title} s" for _, title in _TIMES), "bubble", "tok/s/GPU", "",
                  title=f"estimated steps of the fastest layouts that fit ({cluster.gpu_tflops:g} TFLOP/s per GPU "
                        f"at {cluster.efficiency:.0%}; estimates, see the plan's assumptions)")
    for fit in plan.tradeoffs[:TRADEOFF_ROWS]:
        t = fit.time
        note = "recommended" if fit == plan.recommended else "" if fit.available else "not for this job"
        table.add_row(_shape(fit).replace(", ", " ") + (" ckpt" if fit.activation_checkpointing else ""),
                      f"{fit.total_bytes / 2**30:,.0f}", f"{t.step_seconds:,.1f}",
                      *(f"{t.seconds[key]:,.1f}" for key, _ in _TIMES), f"{t.bubble_fraction:.0%}",
                      f"{t.tokens_per_second_per_gpu:,.0f}", note)
    return table


def print_plan(console, plan: Plan) -> None:
    """What `moetune plan` prints."""
    console.print(plan_table(plan))
    if plan.tradeoffs:
        console.print(tradeoff_table(plan))
    for line in plan_summary(plan):
        console.print(line)


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
    if not plan.submitted.available:
        lines.append("[yellow]as submitted: a job of this configuration cannot run these pipeline stages yet (a "
                     "submission gets a 422 that says why)[/]")
    if plan.recommended:
        best = plan.recommended
        lines.append(f"recommended (the fastest that fits and runs): {_shape(best)}, about "
                     f"{best.time.tokens_per_second_per_gpu:,.0f} tokens/s per GPU (estimated); tuner starts at "
                     f"micro-batch {best.tuner_start_micro_batch}")
        if plan.runner_up:
            lines.append(f"runner-up: {_shape(plan.runner_up)}, {plan.runner_up_slower}")
    else:
        lines.append(f"[red]no layout of {plan.submitted.parallelism.num_workers} workers fits[/]")
    return lines
