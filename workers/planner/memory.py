"""Bytes one rank holds for a layout (the parallel layout, activation checkpointing, micro-batch), from the
model's facts (planner.model). What DeepSpeed holds follows the engine's configuration (workers.engine.deepspeed):
torch AdamW as the client optimizer under ZeRO 1/2/3 with DeepSpeed's defaults, so each optimizer group keeps an
fp32 master copy and AdamW's two fp32 moments of its partition; a group's flat size is padded to a multiple of
2 × its data-parallel size (DeepSpeed's alignment), the non-expert LoRA over all ranks, the expert LoRA over the
ranks that hold the same experts (world / EP)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetune.api.models.parallelism import ParallelDims
from moetune.workers.weights.batches import greedy_batches

# Stated allowances (not measured): the CUDA context with PyTorch's kernels loaded, NCCL communicators of the
# world, EP and replica groups, and the caching allocator's slack.
CUDA_CONTEXT_BYTES = 3 * 2**30
USABLE_FRACTION = 0.9  # of device memory a plan may fill (the tuner's default budget on GPUs)
# DeepSpeed's defaults (deepspeed.runtime.zero.config): the gradient-reduction bucket, allocated whole at the first
# backward (two with ZeRO-3, which overlaps communication), and ZeRO-3's parameter prefetch.
REDUCE_BUCKET_ELEMENTS = 500_000_000
PREFETCH_BUCKET_ELEMENTS = 50_000_000
OPTIMIZER_BYTES_PER_ELEMENT = 12  # fp32 master + exp_avg + exp_avg_sq


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims
    checkpointing: bool
    micro_batch: int  # examples
    sequences: int = 1  # per example (api.preference.sequences_per_example: DPO's chosen and rejected)


def partition(numel: int, dp: int) -> int:
    """Elements of a flat optimizer group one rank of `dp` holds (DeepSpeed pads the group to 2·dp)."""
    if numel == 0:
        return 0
    align = 2 * dp
    return math.ceil(numel / align) * align // dp


def breakdown(model, layout: Layout) -> dict[str, object]:
    """Bytes per rank by part, on the pipeline stage that holds most; `model` is a planner.model.ModelFacts."""
    stages = layout.dims.pipeline_parallel_size
    return max((stage_breakdown(model, layout, stage) for stage in range(stages)), key=total)


def stage_breakdown(model, layout: Layout, stage: int) -> dict[str, object]:
    """Bytes per rank of pipeline stage `stage` by part. With context parallelism the activations, logits and
    all-to-all buffers are those of the rank's slice (the last rank's: it gathers the most keys); the LoRA, its
    gradients and the optimizer state partition as without (CP ranks reduce like data-parallel ones). A stage holds
    its layers' share of the LoRA and, under 1F1B, the saved activations of `stages - stage` micro-batches (the
    forwards it runs before its first backward)."""
    dims = layout.dims
    w, ep, z, stages = dims.stage_size, dims.expert_parallel_size, dims.zero_stage, dims.pipeline_parallel_size
    m = layout.micro_batch * layout.sequences
    layers = model.stage_layers(stages)[stage]
    share = len(layers) / model.num_layers
    dense, experts = round(model.lora_dense * share), round(model.lora_experts * share) // ep
    parts = partition(dense, w) + partition(experts, w // ep)
    cd, cp = model.compute_bytes, dims.context_parallel_size
    last = stage == stages - 1
    moe = any(i in model.moe_layers for i in layers)
    found = {
        "frozen_weights": _frozen(model.stage_tensors(stages, stage), layout),
        "lora_parameters": (parts if z == 3 else dense + experts) * cd,
        "lora_gradients": (dense + experts if z == 1 else parts) * cd,
        "optimizer_state": parts * OPTIMIZER_BYTES_PER_ELEMENT,
        "activations": _stage_activations(model, layout, stage, layers) * m,
        "logits": model.loss_bytes(cp) * m if last else 0,
        "loss_chunk": model.logits_chunk(m, model.slice_tokens(cp)) if last else 0,
        "all_to_all": model.all_to_all_bytes(ep, cp) * m if moe else 0,
        "zero_buckets": REDUCE_BUCKET_ELEMENTS * cd * (2 if z == 3 else 1),
        "zero3_gather": (model.largest_layer_bytes(ep, layers) + PREFETCH_BUCKET_ELEMENTS * cd) if z == 3 else 0,
        "cuda_context": CUDA_CONTEXT_BYTES,
    }
    if stages > 1:  # what crosses its boundaries: each micro-batch in flight's input, one output being sent
        carried = (stages - stage) * model.boundary_tensors(layers.start) * (stage > 0) + \
            (model.boundary_tensors(layers.stop) if not last else 0)
        found["pipeline_buffers"] = carried * m * model.slice_tokens(cp) * model.hidden * cd
    return found


def _stage_activations(model, layout: Layout, stage: int, layers: range) -> float:
    """Saved bytes of one sequence on stage `stage` (the whole model at one stage): its layers' (the experts'
    share at the layout's EP), what the forward saves before the layers on the first stage and after them on the
    last; with recomputation each layer's input, and one layer rerun at a time."""
    ep, cp, stages = layout.dims.expert_parallel_size, layout.dims.context_parallel_size, \
        layout.dims.pipeline_parallel_size
    measured, per_layer = model.activations(cp), model.layer_bytes(ep, cp)
    in_flight = stages - stage
    outside = (measured.before_layers if stage == 0 else 0.0) + \
        (measured.outside - measured.before_layers if stage == stages - 1 else 0.0)
    if layout.checkpointing:
        kept = outside + sum(measured.layer_inputs[i] for i in layers)
        return in_flight * kept + max((per_layer[i] for i in layers), default=0.0)
    return in_flight * (outside + sum(per_layer[i] for i in layers))


def _frozen(tensors, layout: Layout) -> dict[str, float]:
    """Frozen bytes one rank holds of `tensors` (its stage's) by label: the routed experts at its 1/EP; under
    ZeRO-3 each parameter's partition (experts over the stage's ranks holding the same ones, the rest over the
    stage's ranks)."""
    w, ep = layout.dims.stage_size, layout.dims.expert_parallel_size
    frozen: dict[str, float] = {}
    for t in tensors:
        partitions = (w // ep if t.expert else w) if layout.dims.zero_stage == 3 and t.partitionable else 1
        frozen[t.label] = frozen.get(t.label, 0.0) + t.nbytes / (ep if t.expert else 1) / partitions
    return frozen


def _zero3_load_excess(model, layout: Layout) -> float:
    """Bytes over its final partitions a rank holds at the worst moment of a ZeRO-3 load, the loader simulated
    (workers.weights.loader): the held buffers and quantized weights first, then the partitioned parameters in the
    model's order, in workers.weights.batches' batches; while a batch's first parameter is partitioned, the rank
    holds the partitions made so far, the whole batch and that partition."""
    w, ep = layout.dims.num_workers, layout.dims.expert_parallel_size
    held = sum(t.nbytes / (ep if t.expert else 1) for t in model.tensors if not t.partitionable)
    whole = [t.nbytes / (ep if t.expert else 1) for t in model.tensors if t.partitionable]
    part = [t.nbytes / (ep if t.expert else 1) / (w // ep if t.expert else w) for t in model.tensors
            if t.partitionable]
    peak = 0.0
    for batch in greedy_batches(whole):
        peak = max(peak, held + sum(whole[i] for i in batch) + part[batch[0]])
        held += sum(part[i] for i in batch)
    return max(0.0, peak - held)


def load_breakdown(model, layout: Layout) -> dict[str, float]:
    """Bytes one rank holds at load (workers.weights.loader), on the pipeline stage that holds most: its stage's
    tensors only. ZeRO-1/2: every frozen tensor whole, the routed experts at this rank's 1/EP. ZeRO-3 (one stage):
    the loader fills the parameters a batch at a time, no batch larger than the largest parameter, and partitions
    each as soon as it is filled: the frozen weights as in training (quantized ones are held buffers, whole at
    1/EP), plus what its worst batch holds whole beyond them. PEFT adds the LoRA parameters whole (DeepSpeed's
    initialize partitions them)."""
    stages = layout.dims.pipeline_parallel_size
    return max((_stage_load(model, layout, stage) for stage in range(stages)), key=total)


def _stage_load(model, layout: Layout, stage: int) -> dict[str, float]:
    stages = layout.dims.pipeline_parallel_size
    share = len(model.stage_layers(stages)[stage]) / model.num_layers
    lora = round(model.lora_dense * share) + round(model.lora_experts * share) // layout.dims.expert_parallel_size
    return {"frozen_weights": sum(_frozen(model.stage_tensors(stages, stage), layout).values()),
            "lora_parameters": lora * model.compute_bytes,
            "load_batch": _zero3_load_excess(model, layout) if layout.dims.zero_stage == 3 else 0.0,
            "cuda_context": CUDA_CONTEXT_BYTES}


def total(parts: dict[str, object]) -> float:
    return sum(sum(v.values()) if isinstance(v, dict) else v for v in parts.values())
