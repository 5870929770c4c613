"""A job's plan on a cluster: the per-GPU breakdown of the job as submitted; the layouts of its workers that fit
(context parallelism only where nothing fits without), each with its estimated step time (planner.timing), the
fastest one a job can run recommended and the next fastest beside it with why it is slower; the tuner's starting
micro-batch, the fewest GPUs any layout fits on (the smallest: EP, then ZeRO stage, then activation
checkpointing), and the load time (api.plans.Plan)."""

from __future__ import annotations

from dataclasses import replace

from moetune.api.models.base import SpecError
from moetune.api.models.parallelism import ParallelDims
from moetune.api.models.run_config import RunConfig, micro_batches_refusal, pipeline_refusal
from moetune.api.plans import ClusterSpec, Plan, PlannedCluster, PlannedLayout, PlannedLoad, PlannedModel
from moetune.api.preference import sequences_per_example
from moetune.workers.planner.memory import (
    CUDA_CONTEXT_BYTES,
    USABLE_FRACTION,
    Layout,
    breakdown,
    load_breakdown,
    total,
)
from moetune.workers.planner.model import ROUTING_SKEW, ModelFacts, model_facts
from moetune.workers.planner.timing import BACKWARD_ATTENTION, estimate


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _checkpointing_options(run: RunConfig, choose_checkpointing: bool) -> tuple[bool, ...]:
    return (False, True) if choose_checkpointing else (run.training.activation_checkpointing,)


def _layout(run: RunConfig, dims: ParallelDims, checkpointing: bool, micro_batch: int | None = None) -> Layout:
    return Layout(dims, checkpointing, run.training.micro_batch_size if micro_batch is None else micro_batch,
                  sequences_per_example(run.method))


def _layouts(facts: ModelFacts, run: RunConfig, world: int, choose_checkpointing: bool, context: int,
             available_only: bool):
    """Layouts of `world` workers at `context` CP ranks in the order a plan prefers them among equals: the fewest
    pipeline stages, then the smallest EP, then ZeRO stage, then no recomputation; only those the run config's
    rules accept (the worker count and the global batch divide; `available_only`: and the workers run)."""
    eps = [d for d in _divisors(world) if not facts.num_experts or facts.num_experts % d == 0]
    for stages in (s for s in _divisors(world) if s <= min(facts.most_stages, facts.num_layers)):
        for ep in eps:
            for zero in (1, 2, 3):
                dims = run.parallelism.model_copy(update={
                    "num_workers": world, "expert_parallel_size": ep, "context_parallel_size": context,
                    "pipeline_parallel_size": stages, "zero_stage": zero})
                if not _accepted(run, dims, available_only):
                    continue
                for checkpointing in _checkpointing_options(run, choose_checkpointing):
                    yield _layout(run, dims, checkpointing)


def _accepted(run: RunConfig, dims: ParallelDims, available_only: bool) -> bool:
    if not _passes(dims.check_world) or available_only and not _runs(run, dims):
        return False
    micro = 1 if run.training.tune_micro_batch else run.training.micro_batch_size
    return (run.training.global_batch_size % (dims.data_parallel_size * micro) == 0
            and micro_batches_refusal(dims, run.training.global_batch_size, micro) is None)


def _runs(run: RunConfig, dims: ParallelDims) -> bool:
    """Whether a job of this run config can run the layout (pipeline stages: not every job)."""
    return pipeline_refusal(dims, run.method, run.evaluation) is None


def _passes(check) -> bool:
    try:
        check()
    except SpecError:
        return False
    return True


def _evaluate(facts: ModelFacts, layout: Layout, usable: float, run: RunConfig,
              cluster: ClusterSpec) -> PlannedLayout:
    parts, at_load = breakdown(facts, layout), load_breakdown(facts, layout)
    used, loading = total(parts), total(at_load)
    return PlannedLayout(parallelism=layout.dims, activation_checkpointing=layout.checkpointing,
                         micro_batch_size=layout.micro_batch, bytes=parts, total_bytes=used, load_bytes=at_load,
                         load_total_bytes=loading, fits=used <= usable and loading <= usable,
                         time=estimate(facts, layout, cluster, run.training.global_batch_size),
                         available=_runs(run, layout.dims))


def _first_fit(facts: ModelFacts, run: RunConfig, world: int, usable: float, choose_checkpointing: bool,
               cluster: ClusterSpec) -> PlannedLayout | None:
    """The smallest layout of `world` workers a job can run that fits."""
    return next((e for context in facts.context_sizes
                 for layout in _layouts(facts, run, world, choose_checkpointing, context, available_only=True)
                 if (e := _evaluate(facts, layout, usable, run, cluster)).fits), None)


def _fastest(facts: ModelFacts, run: RunConfig, usable: float, choose_checkpointing: bool,
             cluster: ClusterSpec) -> list[PlannedLayout]:
    """The fitting layouts of the job's workers, fastest first, up to the fewest CP ranks at which one a job can
    run fits; of those alike but for ZeRO stage and recomputation, the fastest (the preferred among equals)."""
    fitting: list[PlannedLayout] = []
    for context in facts.context_sizes:
        fitting += [e for layout in _layouts(facts, run, run.parallelism.num_workers, choose_checkpointing, context,
                                             available_only=False)
                    if (e := _evaluate(facts, layout, usable, run, cluster)).fits]
        if any(e.available for e in fitting):
            break
    shapes: dict[tuple[int, int, int], PlannedLayout] = {}
    for e in sorted(fitting, key=lambda e: e.time.step_seconds):
        par = e.parallelism
        shapes.setdefault((par.expert_parallel_size, par.context_parallel_size, par.pipeline_parallel_size), e)
    return list(shapes.values())


def _why_slower(slower: PlannedLayout, faster: PlannedLayout) -> str:
    """What costs `slower` its time against `faster`: the kind of step time that grows most."""
    a, b = slower.time, faster.time
    kind = max(a.seconds, key=lambda k: a.seconds[k] - b.seconds[k])
    waits = f"; its pipeline waits {a.bubble_fraction:.0%} of the step" if a.bubble_fraction else ""
    unavailable = "" if slower.available else " (and this job's settings cannot run its pipeline stages)"
    return (f"{a.step_seconds / b.step_seconds:.2f}x the step time (estimated): {kind.replace('_', ' ')} "
            f"{a.seconds[kind]:,.1f} s a step against {b.seconds[kind]:,.1f} s{waits}{unavailable}")


def largest_fitting_micro_batch(facts: ModelFacts, layout: Layout, per_rank: int, usable: float) -> int:
    """The largest divisor of the per-rank batch whose micro-batch fits `usable` bytes (the tuner's start)."""
    fitting = [m for m in _divisors(per_rank) if total(breakdown(facts, replace(layout, micro_batch=m))) <= usable]
    return max(fitting, default=1)


def _gpu_counts(cluster: ClusterSpec) -> list[int]:
    """Worker counts tried for the fewest GPUs: powers of two within a node, then whole nodes."""
    within = [n for n in (2**i for i in range(7)) if n < cluster.gpus_per_node]
    return within + [cluster.gpus_per_node * k for k in range(1, cluster.nodes + 1)]


def plan(config: dict, run: RunConfig, cluster: ClusterSpec, choose_checkpointing: bool = False,
         facts: ModelFacts | None = None) -> Plan:
    """The plan of `run` on `cluster`, one GPU per worker; `choose_checkpointing`: the request left activation
    checkpointing "auto", so the plan turns it on only where nothing fits without it."""
    facts = facts or model_facts(config, run)
    usable = USABLE_FRACTION * cluster.gpu_memory_bytes
    par = run.parallelism
    world = par.num_workers
    for checkpointing in _checkpointing_options(run, choose_checkpointing):
        if (submitted := _evaluate(facts, _layout(run, par, checkpointing), usable, run, cluster)).fits:
            break
    tradeoffs = _fastest(facts, run, usable, choose_checkpointing, cluster)
    at = next((i for i, e in enumerate(tradeoffs) if e.available), None)
    recommended = None if at is None else tradeoffs[at]
    runner_up = tradeoffs[at + 1] if at is not None and at + 1 < len(tradeoffs) else None
    if recommended is not None:
        best = _layout(run, recommended.parallelism, recommended.activation_checkpointing, micro_batch=1)
        per_rank = run.training.global_batch_size // recommended.parallelism.data_parallel_size
        recommended.tuner_start_micro_batch = largest_fitting_micro_batch(facts, best, per_rank, usable)
    fewest = next((fit for n in _gpu_counts(cluster) if (fit := _first_fit(facts, run, n, usable,
                                                                           choose_checkpointing, cluster))), None)
    ep = (recommended or fewest or submitted).parallelism.expert_parallel_size
    per_rank_bytes = facts.load_bytes(ep)
    node_bytes = per_rank_bytes * min(cluster.gpus_per_node, world)
    return Plan(
        model=PlannedModel(model_type=facts.model_type, parameters=facts.parameters,
                           quantization=facts.quantization, routed_experts=facts.num_experts,
                           experts_per_token=facts.top_k, lora_parameters=facts.lora_dense + facts.lora_experts,
                           expert_lora_parameters=facts.lora_experts),
        cluster=PlannedCluster(nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node, gpus=cluster.gpus,
                               gpu_memory=cluster.gpu_memory_bytes, gpu_memory_gib=cluster.gpu_memory,
                               nic=cluster.nic, usable_bytes_per_gpu=usable, gpu_tflops=cluster.gpu_tflops,
                               efficiency=cluster.efficiency, nvlink=cluster.nvlink, network=cluster.network,
                               overlap=cluster.overlap),
        seq_len=facts.seq_len,
        compute_dtype_bytes=facts.compute_bytes,
        activation_bytes_per_token={
            "without_checkpointing": facts.activation_bytes(ep, False) / facts.seq_len,
            "with_checkpointing": facts.activation_bytes(ep, True) / facts.seq_len,
            "logits": facts.loss_bytes() / facts.seq_len},
        submitted=submitted.model_copy(update={"gpus_available": world <= cluster.gpus}),
        recommended=recommended,
        runner_up=runner_up,
        runner_up_slower=_why_slower(runner_up, recommended) if runner_up else None,
        tradeoffs=tradeoffs,
        fewest_gpus=fewest,
        load=PlannedLoad(bytes_per_rank=per_rank_bytes, bytes_per_node=node_bytes,
                         seconds=node_bytes * 8 / cluster.nic, expert_parallel_size=ep),
        assumptions="one GPU per worker; every sequence seq_len tokens; with EP > 1 the busiest rank receives "
                    f"{ROUTING_SKEW:g}x an even share of the routed tokens; fits = at most "
                    f"{USABLE_FRACTION:.0%} of a GPU's memory with a stated {CUDA_CONTEXT_BYTES / 2**30:g} GiB for "
                    "the CUDA context and communicators, both in training and at load (load_total_bytes; under "
                    "ZeRO-3 the loader partitions each parameter as it loads it); load time = the bytes a node's "
                    "ranks stream over its NIC (no cache); with context parallelism, a rank's activations are those of "
                    "the group's last rank (its slice, the whole row's gathered MLA keys, every rank's KDA state "
                    "summary); a pipeline stage's bytes are those of the stage that holds most (1F1B: the first "
                    "holds as many micro-batches' activations as there are stages). Step times are estimates: "
                    f"operations at {cluster.efficiency:.0%} of {cluster.gpu_tflops:g} TFLOP/s per GPU (stated), "
                    "attention's backward "
                    f"{BACKWARD_ATTENTION:g}x its forward; collectives over NVLink ({cluster.nvlink / 8e9:g} GB/s) "
                    f"within a node, over the GPU's network link ({cluster.network / 1e9:g} Gb/s) beyond; ZeRO-3's "
                    f"gathers {'overlap' if cluster.overlap else 'do not overlap'} the compute, nothing else does; "
                    "pipelines run 1F1B. A layout a job of this configuration cannot run is marked available: false "
                    "(pipeline stages with a method other than SFT, context parallelism or generation-based "
                    "evaluation)",
    )
