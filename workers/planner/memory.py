"""Bytes one rank holds for a layout (world size, EP, ZeRO stage, activation checkpointing, micro-batch), from the
model's facts (planner.model). What DeepSpeed holds follows the engine's configuration (workers.engine.deepspeed):
torch AdamW as the client optimizer under ZeRO 1/2/3 with DeepSpeed's defaults, so each optimizer group keeps an
fp32 master copy and AdamW's two fp32 moments of its partition; a group's flat size is padded to a multiple of
2 × its data-parallel size (DeepSpeed's alignment), the non-expert LoRA over all ranks, the expert LoRA over the
ranks that hold the same experts (world / EP)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    world: int
    ep: int
    zero: int
    checkpointing: bool
    micro_batch: int


def partition(numel: int, dp: int) -> int:
    """Elements of a flat optimizer group one rank of `dp` holds (DeepSpeed pads the group to 2·dp)."""
    if numel == 0:
        return 0
    align = 2 * dp
    return math.ceil(numel / align) * align // dp


def breakdown(model, layout: Layout) -> dict[str, object]:
    """Bytes per rank by part; `model` is a planner.model.ModelFacts."""
    w, ep, z, m = layout.world, layout.ep, layout.zero, layout.micro_batch
    replicas = w // ep
    frozen: dict[str, float] = {}
    for t in model.tensors:
        share = (1 / ep if t.expert else 1.0) / ((replicas if t.expert else w) if z == 3 and t.partitionable else 1)
        frozen[t.label] = frozen.get(t.label, 0.0) + t.nbytes * share
    dense, experts = model.lora_dense, model.lora_experts // ep
    parts = partition(dense, w) + partition(experts, replicas)
    cd = model.compute_bytes
    seq = model.seq_len
    act = model.activation_bytes(ep, layout.checkpointing)
    slots = seq * model.top_k * m
    return {
        "frozen_weights": frozen,
        "lora_parameters": (parts if z == 3 else dense + experts) * cd,
        "lora_gradients": (dense + experts if z == 1 else parts) * cd,
        "optimizer_state": parts * OPTIMIZER_BYTES_PER_ELEMENT,
        "activations": act * m,
        "logits": model.activations.loss * m,
        "all_to_all": 2 * slots * model.expert_width * cd if ep > 1 else 0,
        "zero_buckets": REDUCE_BUCKET_ELEMENTS * cd * (2 if z == 3 else 1),
        "zero3_gather": (model.largest_layer_bytes(ep) + PREFETCH_BUCKET_ELEMENTS * cd) if z == 3 else 0,
        "cuda_context": CUDA_CONTEXT_BYTES,
    }


def _largest_partition(model, layout: Layout) -> float:
    """Bytes of the largest ZeRO-3 partition one rank holds of a frozen parameter (experts over the ranks holding
    the same ones, the rest over all ranks)."""
    replicas = layout.world // layout.ep
    return max((t.nbytes / (layout.ep * replicas if t.expert else layout.world) for t in model.tensors
                if t.partitionable), default=0.0)


def load_breakdown(model, layout: Layout) -> dict[str, float]:
    """Bytes one rank holds at load, before ZeRO-3 has partitioned anything: the streaming loader
    (workers.weights.loader) allocates every frozen tensor whole, the routed experts at this rank's 1/EP, and PEFT
    adds the LoRA parameters whole. Under ZeRO-3, DeepSpeed's initialize then converts one parameter at a time,
    allocating its partition before it frees the whole tensor: the largest partition comes on top, once."""
    lora = model.lora_dense + model.lora_experts // layout.ep
    return {"frozen_weights": model.load_bytes(layout.ep), "lora_parameters": lora * model.compute_bytes,
            "zero3_conversion": _largest_partition(model, layout) if layout.zero == 3 else 0.0,
            "cuda_context": CUDA_CONTEXT_BYTES}


def total(parts: dict[str, object]) -> float:
    return sum(sum(v.values()) if isinstance(v, dict) else v for v in parts.values())
