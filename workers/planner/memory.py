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
    """Bytes per rank by part; `model` is a planner.model.ModelFacts. With context parallelism the activations,
    logits and all-to-all buffers are those of the rank's slice (the last rank's: it gathers the most keys); the
    LoRA, its gradients and the optimizer state partition as without (CP ranks reduce like data-parallel ones)."""
    w, ep, z = layout.dims.num_workers, layout.dims.expert_parallel_size, layout.dims.zero_stage
    m = layout.micro_batch * layout.sequences
    replicas = w // ep
    frozen = _frozen(model, layout)
    dense, experts = model.lora_dense, model.lora_experts // ep
    parts = partition(dense, w) + partition(experts, replicas)
    cd, cp = model.compute_bytes, layout.dims.context_parallel_size
    return {
        "frozen_weights": frozen,
        "lora_parameters": (parts if z == 3 else dense + experts) * cd,
        "lora_gradients": (dense + experts if z == 1 else parts) * cd,
        "optimizer_state": parts * OPTIMIZER_BYTES_PER_ELEMENT,
        "activations": model.activation_bytes(ep, layout.checkpointing, cp) * m,
        "logits": model.loss_bytes(cp) * m,
        "loss_chunk": model.logits_chunk(m, model.slice_tokens(cp)),
        "all_to_all": model.all_to_all_bytes(ep, cp) * m,
        "zero_buckets": REDUCE_BUCKET_ELEMENTS * cd * (2 if z == 3 else 1),
        "zero3_gather": (model.largest_layer_bytes(ep) + PREFETCH_BUCKET_ELEMENTS * cd) if z == 3 else 0,
        "cuda_context": CUDA_CONTEXT_BYTES,
    }


def _frozen(model, layout: Layout) -> dict[str, float]:
    """Frozen bytes one rank holds by label: the routed experts at its 1/EP; under ZeRO-3 each parameter's
    partition (experts over the ranks holding the same ones, the rest over all ranks)."""
    w, ep = layout.dims.num_workers, layout.dims.expert_parallel_size
    frozen: dict[str, float] = {}
    for t in model.tensors:
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
    """Bytes one rank holds at load (workers.weights.loader). ZeRO-1/2: every frozen tensor whole, the routed
    experts at this rank's 1/EP. ZeRO-3: the loader fills the parameters a batch at a time, no batch larger than
    the largest parameter, and partitions each as soon as it is filled: the frozen weights as in training (quantized
    ones are held buffers, whole at 1/EP), plus what its worst batch holds whole beyond them. PEFT adds the LoRA
    parameters whole (DeepSpeed's initialize partitions them)."""
    lora = model.lora_dense + model.lora_experts // layout.dims.expert_parallel_size
    return {"frozen_weights": sum(_frozen(model, layout).values()),
            "lora_parameters": lora * model.compute_bytes,
            "load_batch": _zero3_load_excess(model, layout) if layout.dims.zero_stage == 3 else 0.0,
            "cuda_context": CUDA_CONTEXT_BYTES}


def total(parts: dict[str, object]) -> float:
    return sum(sum(v.values()) if isinstance(v, dict) else v for v in parts.values())
