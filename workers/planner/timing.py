"""A layout's estimated optimizer step: the operations each rank computes at a stated share of the GPU's peak,
and the bytes each collective moves over the link it crosses (api.plans.PlannedTime). Every figure is an estimate
from the model's facts (planner.model) and the cluster's stated figures (api.plans.ClusterSpec); bench/
pipeline_calibration.py checks it against measured steps on CPU ranks.

- Operations: a token's matmuls read each weight once (two operations per weight: the dense ones, its top-k
  experts', the LoRA), forward, again under recomputation, and once more in the backward for the input gradients
  (frozen weights get no weight gradient; LoRA's, at its rank, is left out); attention and KDA as their kernels'
  operations measured on the meta device (planner.work), their backward BACKWARD_ATTENTION times their forward.
  At EP > 1 the busiest rank's experts compute ROUTING_SKEW times an even share.
- Collectives, each over NVLink where its group fits in a node, else over the GPU's network link: the expert
  all-to-all (dispatch and combine, in the forward, the rerun and the backward), ZeRO-3's parameter gathers (the
  same three passes, prefetched: they overlap the compute where the cluster says so), the CP all-gathers (forward and rerun; the backward
  reduces as many bytes), the pipeline's sends (activations forward, their gradients back) and the LoRA gradients'
  reduction once a step.
- A pipeline runs 1F1B: (micro-batches + stages - 1) of its slowest stage's micro-batch steps.
"""

from __future__ import annotations

import math

from moetune.api.plans import ClusterSpec, PlannedTime
from moetune.workers.planner.memory import Layout
from moetune.workers.planner.model import ModelFacts

BACKWARD_ATTENTION = 2.0  # flash attention's and fla's backward over their forward (dq, dk, dv)


def _link(cluster: ClusterSpec, group: int) -> float:
    """Bytes per second a group of `group` consecutive ranks moves between its members."""
    return (cluster.nvlink if group <= cluster.gpus_per_node else cluster.network) / 8


def _ring(nbytes: float, group: int) -> float:
    """Bytes one rank sends or receives for a ring all-gather (or reduce-scatter) of `nbytes` over `group`."""
    return nbytes * (group - 1) / group if group > 1 else 0.0


def _stage_seconds(facts: ModelFacts, layout: Layout, cluster: ClusterSpec, stage: int) -> dict[str, float]:
    """One micro-batch's seconds on a rank of pipeline stage `stage`, by kind, and its operations ("flops")."""
    dims = layout.dims
    ep, cp, stages = dims.expert_parallel_size, dims.context_parallel_size, dims.pipeline_parallel_size
    layers = facts.stage_layers(stages)[stage]
    sequences = layout.micro_batch * layout.sequences
    tokens = sequences * facts.slice_tokens(cp)
    passes = 3 if layout.checkpointing else 2  # forward, (rerun), backward
    linear = sum(facts.linear_elements(ep)[i] for i in layers)
    if stage == stages - 1:
        linear += facts.head_elements * 2 / passes  # the output layer: forward and input gradients, never rerun
    attention = sum(facts.activations(cp).attention_flops[i] for i in layers)
    flops = tokens * 2 * linear * passes + sequences * attention * (passes - 1 + BACKWARD_ATTENTION)
    cd = facts.compute_bytes
    moe_layers = sum(i in facts.moe_layers for i in layers)
    routed = tokens * facts.top_k * facts.expert_width * cd * moe_layers
    gathered = sum(t.nbytes / (ep if t.expert else 1) for t in facts.stage_tensors(stages, stage) if t.partitionable)
    sends = (facts.boundary_tensors(layers.start) if stage > 0 else 0) + \
        (facts.boundary_tensors(layers.stop) if stage < stages - 1 else 0)
    return {
        "flops": flops,
        "compute": flops / (cluster.gpu_tflops * 1e12 * cluster.efficiency),
        "zero3_gather": (_ring(gathered, dims.stage_size) * passes / _link(cluster, dims.stage_size)
                         if dims.zero_stage == 3 else 0.0),
        "all_to_all": 2 * passes * _ring(routed, ep) / _link(cluster, ep),
        "context_exchange": sequences * facts.activations(cp).received * passes / _link(cluster, cp),
        # a stage's peers are a stage's ranks away
        "pipeline_sends": 2 * sends * tokens * facts.hidden * cd / _link(cluster, dims.stage_size + 1),
    }


def estimate(facts: ModelFacts, layout: Layout, cluster: ClusterSpec, global_batch: int) -> PlannedTime:
    """The step of `layout` with `global_batch` examples of `facts.seq_len` tokens."""
    dims = layout.dims
    stages = dims.pipeline_parallel_size
    per_stage = [_stage_seconds(facts, layout, cluster, s) for s in range(stages)]
    kinds = ("compute", "zero3_gather", "all_to_all", "context_exchange", "pipeline_sends")

    def micro_step(s: dict[str, float]) -> float:
        work = max(s["compute"], s["zero3_gather"]) if cluster.overlap else s["compute"] + s["zero3_gather"]
        return work + s["all_to_all"] + s["context_exchange"] + s["pipeline_sends"]

    slowest = max(per_stage, key=micro_step)
    micro_batches = math.ceil(global_batch / dims.data_parallel_size / layout.micro_batch)
    slots = micro_batches + stages - 1
    lora = (facts.lora_dense + facts.lora_experts / dims.expert_parallel_size) / stages * facts.compute_bytes
    reduce = 2 * _ring(lora, dims.stage_size) / _link(cluster, dims.stage_size)
    seconds = {kind: slots * slowest[kind] for kind in kinds} | {"gradient_reduce": reduce}
    step = slots * micro_step(slowest) + reduce
    tokens = global_batch * layout.sequences * facts.seq_len
    rank_tokens = layout.micro_batch * layout.sequences * facts.slice_tokens(dims.context_parallel_size)
    return PlannedTime(step_seconds=step, tokens_per_second_per_gpu=tokens / step / dims.num_workers,
                       micro_batches=micro_batches, bubble_fraction=(stages - 1) / slots,
                       flops_per_token=sum(s["flops"] for s in per_stage) / rank_tokens, seconds=seconds)
