"""What the planner knows about a job's model, from config.json alone: its frozen tensors, LoRA parameter counts
(coverage's, which are PEFT's), the bytes its forward saves per sequence and what its routed experts add."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from moetune.api.models.run_config import RunConfig
from moetune.api.quantization import quantization_of
from moetune.workers.families.spec import Family
from moetune.workers.lora.coverage import ROUTED_EXPERTS, Coverage, coverage, modules
from moetune.workers.methods import method_for
from moetune.workers.model import META, build_model, runs_expert_module
from moetune.workers.planner.activations import Activations, activations
from moetune.workers.planner.experts import ExpertBytes, expert_bytes, input_width
from moetune.workers.planner.weights import Tensor, frozen_tensors

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ModelFacts:
    model_type: str
    parameters: int
    quantization: str | None
    tensors: list[Tensor]
    lora_dense: int  # PEFT's LoRA parameters (attention, dense MLPs, shared experts, ...)
    lora_experts: int  # the routed experts' LoRA, all experts (lora.train_experts)
    num_experts: int
    top_k: int
    expert_width: int  # width of a token crossing the all-to-all
    moe_layers: frozenset[int]
    expert_saved: dict[bool, ExpertBytes]  # by "the expert-parallel module runs them"
    expert_module_at_ep1: bool  # expert LoRA or a quantized base: the expert-parallel module even at EP=1
    activations: Activations
    seq_len: int
    compute_bytes: int

    def layer_bytes(self, ep: int) -> tuple[float, ...]:
        """Each decoder layer's saved bytes for one sequence, with its experts' share at EP=`ep`."""
        layers = self.activations.layers
        if not self.moe_layers:
            return layers
        saved = self.expert_saved[ep > 1 or self.expert_module_at_ep1]
        block = saved.of(self.num_experts // ep, self.seq_len * self.top_k)
        return tuple(b + (block if i in self.moe_layers else 0) for i, b in enumerate(layers))

    def activation_bytes(self, ep: int, checkpointing: bool) -> float:
        """Saved bytes of one sequence at `seq_len` (the loss's excepted) with the experts' share at EP=`ep`."""
        return self.activations.saved(self.layer_bytes(ep), checkpointing)

    def largest_layer_bytes(self, ep: int) -> float:
        """One decoder layer's ZeRO-3-partitioned parameters as gathered on one rank (its experts' share)."""
        per_layer: dict[int, float] = {}
        for t in self.tensors:
            if t.partitionable and t.layer is not None:
                per_layer[t.layer] = per_layer.get(t.layer, 0.0) + t.nbytes / (ep if t.expert else 1)
        return max(per_layer.values(), default=0.0)

    def load_bytes(self, ep: int) -> float:
        """Bytes one rank streams from storage: every non-expert tensor and its experts' share."""
        return sum(t.nbytes / (ep if t.expert else 1) for t in self.tensors)


@dataclass(frozen=True)
class _Base:
    """What the planner reads of the plain model, before any swap or LoRA."""

    tensors: list[Tensor]
    coverage: Coverage
    parameters: int
    moe_layers: frozenset[int]
    experts: object | None  # the first MoE block's experts module (meta tensors)


def _read_base(model, family: Family, config: dict, job: RunConfig, dtype: torch.dtype) -> _Base:
    blocks = list(family.moe_blocks(model))
    return _Base(frozen_tensors(model, family, config, dtype, job.training.base_weights == "dequantized"),
                 coverage(modules(model, family), job.lora, family), sum(p.numel() for p in model.parameters()),
                 frozenset(int(m.group(1)) for name, _ in blocks if (m := _LAYER.search(f".{name}."))),
                 getattr(blocks[0][1], family.experts) if blocks else None)


def model_facts(config: dict, job: RunConfig, dtype: torch.dtype = torch.bfloat16) -> ModelFacts:
    """Builds the model on the meta device (any size, in seconds); `dtype`: the compute dtype (bf16 on GPUs)."""
    built = build_model(META, config, job, dtype=dtype,
                        read_base=lambda model, family: _read_base(model, family, config, job, dtype))
    base, family, quantization = built.base, built.family, quantization_of(config)
    found, experts = base.coverage, base.experts
    routed = found.kinds[ROUTED_EXPERTS].trainable if ROUTED_EXPERTS in found.kinds else 0
    kept_quantized = quantization is not None and job.training.base_weights != "dequantized"
    at_ep1 = runs_expert_module(built.placement, job.lora, kept_quantized)
    saved = ({flag: expert_bytes(experts, family, job.lora, job.training, flag, dtype) for flag in {at_ep1, True}}
             if experts is not None else {})
    text = built.model.config.get_text_config()
    method = method_for(job.method, job.training, tokenizer=None)
    method.prepare(built.model)  # its output layer computes the loss, as in a job
    return ModelFacts(config.get("model_type"), base.parameters, quantization.format if quantization else None,
                      base.tensors, found.trainable - routed, routed, experts.num_experts if experts else 0,
                      getattr(text, "num_experts_per_tok", 0) or 0, input_width(experts) if experts else 0,
                      base.moe_layers, saved, at_ep1, activations(built.model, method, job.training.seq_len),
                      job.training.seq_len, dtype.itemsize)
