"""What the planner knows about a job's model, from config.json alone: its frozen tensors, LoRA parameter counts
(coverage's, which are PEFT's), the bytes its forward saves per sequence and what its routed experts add."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from moetune.api.families import known_facts
from moetune.api.models.run_config import RunConfig, context_parallel_refusal
from moetune.api.quantization import quantization_of
from moetune.kernels.loss.dispatch import logits_chunk_rows
from moetune.workers.families.spec import Family
from moetune.workers.lora.coverage import ROUTED_EXPERTS, Coverage, coverage, modules
from moetune.workers.methods import method_for
from moetune.workers.model import META, build_model, runs_expert_module
from moetune.workers.pipeline.split import stage_bounds
from moetune.workers.planner.activations import Activations, activations
from moetune.workers.planner.experts import ExpertBytes, expert_bytes, input_width
from moetune.workers.planner.weights import Tensor, frozen_tensors

_LAYER = re.compile(r"\.layers\.(\d+)\.")
# Context-parallel sizes a plan tries beyond the job's own: slices shorter than a few fla chunks spend the step
# exchanging state, and 64 ranks hold a 1M-token row in 16K-token slices.
MAX_CONTEXT_PARALLEL = 64
MIN_SLICE_TOKENS = 1024
# The busiest expert-parallel rank's routed tokens over an even share (stated, not measured: a trained router's
# per-rank load varies by step and batch; the review of K3's plan put the busiest at 1.5-2x). A plan holds a rank
# to what its busiest step receives: the experts' saved bytes per routed slot and the all-to-all's receive buffer.
ROUTING_SKEW = 1.5


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
    context_sizes: tuple[int, ...]  # the context-parallel sizes a plan may choose (context_sizes)
    seq_len: int
    compute_bytes: int
    measure: Callable[[int], Activations]  # what one rank of a CP group of that size saves (planner.activations)
    logits_chunk: Callable[[int, int], float]  # the loss's transient logits for (sequences, tokens each)
    hidden: int  # the hidden states' width
    num_layers: int  # decoder layers
    stage_block: int  # layers a pipeline stage keeps whole (FamilyFacts.stage_block; 1 elsewhere)
    _profiles: dict[int, Activations] = field(default_factory=dict, repr=False, compare=False)
    _linear: dict[int, tuple[float, ...]] = field(default_factory=dict, repr=False, compare=False)

    def activations(self, context: int = 1) -> Activations:
        """One sequence's saved bytes on one of `context` CP ranks, measured on first use: a plan reaches few of
        the sizes it may choose, and each costs a meta-device forward."""
        if context not in self._profiles:
            self._profiles[context] = self.measure(context)
        return self._profiles[context]

    @property
    def measured_contexts(self) -> tuple[int, ...]:
        """The context-parallel sizes whose activations were measured so far."""
        return tuple(sorted(self._profiles))

    def slice_tokens(self, context: int) -> int:
        return self.seq_len // context

    def routed_slots(self, ep: int, context: int = 1) -> float:
        """Token copies the busiest rank's experts receive from one sequence's slice: all of them at EP=1, at EP > 1
        ROUTING_SKEW times an even share."""
        return self.slice_tokens(context) * self.top_k * (ROUTING_SKEW if ep > 1 else 1.0)

    def layer_bytes(self, ep: int, context: int = 1) -> tuple[float, ...]:
        """Each decoder layer's saved bytes for one sequence, with its experts' share at EP=`ep` (the busiest
        rank's, routed_slots), on one of `context` CP ranks (its slice's tokens routed)."""
        layers = self.activations(context).layers
        if not self.moe_layers:
            return layers
        saved = self.expert_saved[ep > 1 or self.expert_module_at_ep1]
        block = saved.of(self.num_experts // ep, self.routed_slots(ep, context))
        return tuple(b + (block if i in self.moe_layers else 0) for i, b in enumerate(layers))

    def activation_bytes(self, ep: int, checkpointing: bool, context: int = 1) -> float:
        """Saved bytes of one sequence at `seq_len` (the loss's excepted) with the experts' share at EP=`ep`, on
        one of `context` CP ranks."""
        return self.activations(context).saved(self.layer_bytes(ep, context), checkpointing)

    def loss_bytes(self, context: int = 1) -> float:
        """What the output layer and the loss save for one sequence's slice."""
        return self.activations(context).loss

    def all_to_all_bytes(self, ep: int, context: int = 1) -> float:
        """The expert all-to-all's buffers for one sequence's slice: what it sends and what the busiest rank
        receives (none without EP)."""
        if ep == 1:
            return 0
        sent = self.slice_tokens(context) * self.top_k
        return (sent + self.routed_slots(ep, context)) * self.expert_width * self.compute_bytes

    def largest_layer_bytes(self, ep: int, layers: range | None = None) -> float:
        """One decoder layer's ZeRO-3-partitioned parameters as gathered on one rank (its experts' share), the
        largest of `layers` (all)."""
        per_layer: dict[int, float] = {}
        for t in self.tensors:
            if t.partitionable and t.layer is not None and (layers is None or t.layer in layers):
                per_layer[t.layer] = per_layer.get(t.layer, 0.0) + t.nbytes / (ep if t.expert else 1)
        return max(per_layer.values(), default=0.0)

    # -------------------------------------------------------------- pipeline stages

    def stage_layers(self, stages: int) -> list[range]:
        """Each pipeline stage's decoder layers (workers.pipeline.split: whole blocks, as even as they go)."""
        bounds = stage_bounds(self.num_layers, stages, self.stage_block)
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]

    @property
    def most_stages(self) -> int:
        return -(-self.num_layers // self.stage_block)

    def stage_tensors(self, stages: int, stage: int) -> list[Tensor]:
        """The frozen tensors stage `stage` of `stages` holds: its layers', the embeddings (and a vision tower) on
        the first, the final norm and output layer on the last."""
        layers = self.stage_layers(stages)[stage]

        def held(t: Tensor) -> bool:
            if t.layer is not None:
                return t.layer in layers
            return stage == 0 if t.first_stage else stage == stages - 1

        return [t for t in self.tensors if held(t)]

    def boundary_tensors(self, first_layer: int) -> int:
        """Hidden-sized tensors that cross into a stage starting at `first_layer`: the hidden states, and with
        stage blocks (Kimi K3's Attention Residuals) the running block's sum and every completed block's (the
        embeddings the first)."""
        return 1 if self.stage_block == 1 else 2 + first_layer // self.stage_block

    # -------------------------------------------------------------- operations

    def linear_elements(self, ep: int) -> tuple[float, ...]:
        """Weights one token's matmuls read in each decoder layer, on the busiest of `ep` expert-parallel ranks:
        every dense weight, its top-k experts' (times ROUTING_SKEW at EP > 1: the busiest rank's experts compute
        that many more), and its share of the LoRA."""
        if ep not in self._linear:  # asked for every stage of every layout a plan weighs
            skew = ROUTING_SKEW if ep > 1 else 1.0
            active = self.top_k / self.num_experts * skew if self.num_experts else 0.0
            per_layer = [(self.lora_dense + self.lora_experts * active) / self.num_layers] * self.num_layers
            for t in self.tensors:
                if t.layer is not None:
                    per_layer[t.layer] += t.elements * (active if t.expert else 1)
            self._linear[ep] = tuple(per_layer)
        return self._linear[ep]

    @property
    def head_elements(self) -> int:
        """Weights the last stage's matmuls after the layers read per token (the output layer's)."""
        return sum(t.elements for t in self.tensors if t.layer is None and not t.first_stage)

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


def context_sizes(config: dict, job: RunConfig) -> tuple[int, ...]:
    """The context-parallel sizes a plan may choose: the job's own, and where the job can be split (a family with a
    CP path, a supervised job on the custom kernels) the powers of two up to MAX_CONTEXT_PARALLEL whose slices
    hold at least MIN_SLICE_TOKENS tokens."""
    sizes = {1, job.parallelism.context_parallel_size}
    facts = known_facts(config)
    if facts is not None and facts.context_parallel and not context_parallel_refusal(job.method,
                                                                                     job.training.custom_kernels):
        sizes.update(c for c in (2**i for i in range(1, MAX_CONTEXT_PARALLEL.bit_length()))
                     if job.training.seq_len % c == 0 and job.training.seq_len // c >= MIN_SLICE_TOKENS)
    return tuple(sorted(sizes))


def _logits_chunk(method, device_type: str, dtype: torch.dtype) -> Callable[[int, int], float]:
    """Bytes of the logits the loss holds at once for `sequences` sequences of `tokens` tokens each, beyond what it
    saves (kernels.loss: Liger's chunk on CUDA, in the compute dtype; fp32 CHUNK_TOKENS rows elsewhere), over the
    micro-batch's tokens or one sequence's (DPO's head); none where the loss takes the model's logits (it saves
    their fp32 copy, counted with the loss)."""
    head = method.head
    if head is None:
        return lambda sequences, tokens: 0.0
    vocab, hidden = head.weight.shape
    on_cuda = device_type == "cuda"
    width = vocab * (dtype.itemsize if on_cuda else 4)
    return lambda sequences, tokens: width * logits_chunk_rows(tokens * (1 if head.per_sequence else sequences),
                                                               vocab, hidden, on_cuda)


def model_facts(config: dict, job: RunConfig, dtype: torch.dtype = torch.bfloat16,
                device_type: str = "cuda") -> ModelFacts:
    """Builds the model on the meta device (any size, in seconds; it stays there for the activations' measures);
    `dtype`: the compute dtype (bf16 on GPUs); `device_type`: the workers' (whose kernels save what is counted)."""
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
                      base.moe_layers, saved, at_ep1, context_sizes(config, job), job.training.seq_len,
                      dtype.itemsize, partial(activations, built.model, method, job.training.seq_len, device_type),
                      _logits_chunk(method, device_type, dtype), text.hidden_size, text.num_hidden_layers,
                      family.facts.stage_block(config))
