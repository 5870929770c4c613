"""The expert-parallel experts module (`parallelize` puts it in place of every MoE block's experts): this rank's
experts as fused 3D tensors (plus, with `train_experts`, their per-expert LoRA factors), tokens traded with the
other EP ranks by all-to-all. Expert parameters carry DeepSpeed's expert-parallel tags (workers.engine.experts) so
ZeRO neither averages different experts' gradients nor partitions them over the wrong group.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from moetune.api.models.lora import LoraSpec
from moetune.kernels.quant import held, held_names, hold
from moetune.workers.engine.deepspeed import full_shape, gathered, partitioned
from moetune.workers.engine.experts import as_moe_layer, tag_expert_param
from moetune.workers.comm import checked
from moetune.workers.comm.exchange_stats import ExchangeStats
from moetune.workers.experts.compute import (
    ExpertLoraFactors,
    GatedActivation,
    fused_expert_forward,
    grouped_expert_forward,
)
from moetune.workers.experts.lora_layout import lora_scaling
from moetune.workers.experts.placement import ExpertPlacement
from moetune.workers.families.spec import Family, in_proj_name


def init_expert_lora_a(experts: range, rank: int, hidden: int, intermediate: int, dtype, device):
    """LoRA A of `experts` (global indices) of one block, gate_up then down, like PEFT's kaiming_uniform(a=√5):
    U(-1/√fan_in, 1/√fan_in). The block draws one seed from the global RNG (the same on every rank); expert e draws
    from its own generator seeded from it, so a rank draws only its own experts, and an expert's A is the same
    whatever the EP size. Drawn on the host (the seeded generators are CPU ones: the same numbers on any device),
    then put on `device`, where the weights are."""
    block_seed = int(torch.randint(0, 2**62, (), device="cpu"))

    def uniform(fan_in, which):
        bound = 1.0 / math.sqrt(fan_in)
        return torch.stack([torch.empty(rank, fan_in, dtype=dtype, device="cpu").uniform_(
            -bound, bound, generator=torch.Generator().manual_seed(block_seed + 2 * e + which)) for e in experts])

    return uniform(hidden, 0).to(device), uniform(intermediate, 1).to(device)


def weights_device(weight) -> torch.device:
    """Where a frozen base weight lives: a QuantizedWeights' tensors, a ZeRO-3 partition's own tensor (its
    Parameter's data is an empty placeholder), or the Parameter itself."""
    if hasattr(weight, "tensors"):
        return next(iter(weight.tensors().values())).device
    return getattr(weight, "ds_tensor", weight).device


class _WeightedCombine(torch.autograd.Function):
    """out[t] = Σ_slots weights[slot] · rows[slot] over the slots of token t, accumulated in fp32 (a bf16 index_add
    rounds at every add, in an order that differs run to run), saving `rows` in their own dtype: autograd's
    `rows.float() * weights` would keep an fp32 [T·k, hidden] copy alive until the backward."""

    @staticmethod
    def forward(ctx, rows, weights, token_of, tokens: int):
        ctx.save_for_backward(rows, weights, token_of)
        out = torch.zeros((tokens, rows.shape[-1]), dtype=torch.float32, device=rows.device)
        return out.index_add_(0, token_of, rows.float() * weights)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, token_of = ctx.saved_tensors
        per_slot = grad[token_of]  # [T·k, hidden] fp32
        return ((per_slot * weights).to(rows.dtype), (per_slot * rows.float()).sum(-1, keepdim=True), None, None)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward sends the gradients back the way the tokens came."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, stats: ExchangeStats):
        ctx.splits, ctx.group, ctx.stats = (out_splits, in_splits), group, stats
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        with stats.timed(x, in_splits, dist.get_rank(group)):
            checked.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group, ctx.stats), None, None, None, None


def _exchange(x, out_splits, in_splits, ep: ExpertPlacement, stats: ExchangeStats):
    return x if ep.size == 1 else _AllToAll.apply(x, out_splits, in_splits, ep.group, stats)


def _own_experts(param: nn.Parameter, ep: ExpertPlacement, transposed: bool = False) -> nn.Parameter:
    """This rank's experts of a fused [E, ...] frozen parameter, [E, out, in]. A ZeRO-3 partition the loader made
    of this rank's share is kept as it is (turning a transposed one gathers it whole: gpt-oss's experts are whole
    again until the engine partitions them); a full module is sliced, and cloned: the full tensors must not stay
    alive through a view."""
    if partitioned(param) and not transposed:
        if full_shape(param)[0] != ep.count:
            raise ValueError(f"a ZeRO-3 expert parameter of {full_shape(param)[0]} experts, this rank holds {ep.count}")
        return param.requires_grad_(False)
    with gathered([param] if partitioned(param) else []):
        weight = param.detach()
        own = weight if weight.shape[0] == ep.count else weight[ep.local].clone()
        own = own.transpose(1, 2).contiguous() if transposed else own
    return nn.Parameter(own, requires_grad=False)


class ExpertParallelExperts(nn.Module):
    """Drop-in for a family's `*Experts` module: same call, only this rank's experts stored."""

    def __init__(self, experts: nn.Module, ep: ExpertPlacement, lora_rank: int = 0, lora_alpha: float = 1.0,
                 fused_kernel: bool = True, activation=None):
        nn.Module.__init__(self)  # not super(): the trainable subclass must skip AutoEPMoELayer's own __init__
        quantized = held_names(experts)  # a quantized base: the loader left the frozen experts in their format
        biased = getattr(experts, "has_bias", False)
        # kernels.moe's grouped GEMMs take unbiased weights, dense or quantized; biased experts run one at a time
        self.compute = fused_expert_forward if fused_kernel and not biased else grouped_expert_forward
        self.num_experts = experts.num_experts
        if self.num_experts != ep.num_experts:
            raise ValueError(f"experts module has {self.num_experts} experts, the placement {ep.num_experts}")
        self.num_local_experts = ep.count
        self.ep, self.ep_group_name = ep, ep.group_name
        # `activation`: the family's own (experts.compute's contract); else act_fn(gate) · up, where families
        # without an act_fn attribute (GLM) hard-code SiLU; the clamp is GLM's swiglu_limit or DeepSeek-V4's limit.
        limit = getattr(experts, "swiglu_limit", getattr(experts, "limit", None))
        self.activation = activation or GatedActivation(getattr(experts, "act_fn", nn.functional.silu), limit)
        # The streaming loader allocates only this rank's experts (see _own_experts). Weights are kept [E, out, in]
        # (transposed families' dense tensors are turned; quantized ones are stored that way), gate_up's columns in
        # the checkpoint's order.
        transposed = getattr(experts, "is_transposed", False)
        self.in_proj = in_proj_name(experts)
        for name in (self.in_proj, "down_proj"):
            if name in quantized:
                qweight = held(experts, name)
                if qweight.shape[0] != ep.count:
                    qweight = qweight.with_tensors(**{k: t[ep.local].clone() for k, t in qweight.tensors().items()})
                hold(self, name, qweight)
            else:
                setattr(self, name, _own_experts(getattr(experts, name), ep, transposed))
        self.biased = biased
        if biased:
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                setattr(self, name, _own_experts(getattr(experts, name), ep))
        self.quantized = bool(quantized)
        self.lora_rank = lora_rank
        self.lora_on = bool(lora_rank)  # off: the forward runs the frozen experts alone (expert_lora_off)
        if lora_rank:
            self.lora_scaling = lora_scaling(lora_alpha, lora_rank)
            self._init_lora(ep.local)
        for param in self.parameters():
            tag_expert_param(param, ep.group_name, ep.replica_group)
        # Routed-token counts per global expert from this rank's last forward (for load metrics). On the weights'
        # device: under ZeRO-3 the loader has partitioned the frozen weights already, so DeepSpeed takes the model
        # as zero-initialised and never moves it (a host buffer would stay on the host).
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.long,
                                                              device=self.device), persistent=False)
        self.comm = ExchangeStats()  # this layer's token exchanges (read by workers.metrics)

    def _init_lora(self, local: slice) -> None:
        """A like PEFT's kaiming-uniform init (this rank's experts only, see init_expert_lora_a), B = 0."""
        r = self.lora_rank
        gate_up, down = self.base_weights()
        two_i, hidden = full_shape(gate_up)[1:]
        # a quantized base has no dtype of its own: fp32, until the model joins its compute dtype (workers.model)
        dtype = torch.float32 if self.quantized else gate_up.dtype
        a_gate_up, a_down = init_expert_lora_a(range(local.start, local.stop), r, hidden, full_shape(down)[2],
                                                 dtype, self.device)
        self.lora_gate_up_a = nn.Parameter(a_gate_up)
        self.lora_down_a = nn.Parameter(a_down)
        self.lora_gate_up_b = nn.Parameter(torch.zeros(self.num_local_experts, two_i, r, dtype=dtype,
                                                       device=self.device))
        self.lora_down_b = nn.Parameter(torch.zeros(self.num_local_experts, hidden, r, dtype=dtype,
                                                    device=self.device))

    def base_weights(self) -> tuple:
        """(gate_up or up, down): frozen dense parameters, or QuantizedWeights (a quantized base)."""
        if self.quantized:
            return held(self, self.in_proj), held(self, "down_proj")
        return getattr(self, self.in_proj), self.down_proj

    @property
    def device(self) -> torch.device:
        """Where the frozen experts live, and so everything this module makes."""
        return weights_device(self.base_weights()[0])

    @property
    def has_lora(self) -> bool:
        return self.lora_rank > 0

    def lora_factors(self) -> ExpertLoraFactors | None:
        if not self.lora_on:
            return None
        return ExpertLoraFactors(self.lora_gate_up_a, self.lora_gate_up_b, self.lora_down_a, self.lora_down_b,
                                 self.lora_scaling)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        ep = self.ep
        top_k = top_k_index.shape[-1]
        flat_experts = top_k_index.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)  # (token, slot) pairs grouped by global expert
        token_of = order // top_k
        # counted by index_add, not bincount: CUDA's bincount reads the largest index back to the host
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat_experts.device)
        counts.index_add_(0, flat_experts, torch.ones_like(flat_experts))
        self.tokens_per_expert.copy_(counts)
        biases = (self.gate_up_proj_bias, self.down_proj_bias) if self.biased else None
        if ep.size == 1:  # local experts are the global ones: rows are in expert order already, counts stay on device
            returned = self.compute(hidden_states[token_of], counts, *self.base_weights(), self.activation,
                                    self.lora_factors(), biases)
        else:
            returned = self._exchanged_compute(hidden_states[token_of], counts, biases)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1).float()
        return _WeightedCombine.apply(returned, weights, token_of, hidden_states.shape[0]).to(hidden_states.dtype)

    def _exchanged_compute(self, rows, counts, biases):
        """The local experts' outputs for `rows` (this rank's token copies sorted by global expert), computed on the
        ranks holding their experts; every rank joins both exchanges, also when it sends or receives no token."""
        ep, n_local = self.ep, self.num_local_experts
        send = counts.view(ep.size, n_local)  # [destination EP rank, its local expert]
        recv = torch.empty_like(send)  # [source EP rank, my local expert]
        checked.all_to_all_single(recv, send, group=ep.group)
        # the layer's one host sync: all_to_all_single takes its split sizes as host integers
        in_splits, out_splits = torch.stack((send.sum(1), recv.sum(1))).tolist()
        # received rows are ordered by (source rank, local expert)
        received = _exchange(rows, out_splits, in_splits, ep, self.comm)
        local_expert = torch.arange(n_local, device=recv.device).repeat(ep.size).repeat_interleave(
            recv.flatten(), output_size=received.shape[0])
        by_expert = torch.argsort(local_expert, stable=True)
        y = self.compute(received[by_expert], recv.sum(0), *self.base_weights(), self.activation,
                         self.lora_factors(), biases)
        y = y[torch.argsort(by_expert)]  # back to (source rank, local expert) order
        return _exchange(y, in_splits, out_splits, ep, self.comm)


@contextlib.contextmanager
def expert_lora_off(model):
    """The routed experts of `model` without their own LoRA while inside (it lives outside PEFT, so PEFT's
    disable_adapter leaves it on)."""
    experts = [m for m in model.modules() if isinstance(m, ExpertParallelExperts) and m.has_lora]
    for m in experts:
        m.lora_on = False
    try:
        yield
    finally:
        for m in experts:
            m.lora_on = True


def trainable_experts_class():
    """The class for experts with LoRA: ZeRO reduces their gradients within the replica group only as a DeepSpeed
    MoE layer (workers.engine.experts.as_moe_layer); frozen experts stay ExpertParallelExperts."""
    return as_moe_layer(ExpertParallelExperts)


def quantized_experts(model, family: Family) -> bool:
    """Whether the loader left the frozen experts quantized (transformers' experts module cannot run them)."""
    return any(held_names(getattr(block, family.experts)) for _, block in family.moe_blocks(model))


def expert_parallel(experts, family: Family, placement: ExpertPlacement, lora: LoraSpec | None,
                    fused_kernel: bool = True):
    """The expert-parallel module that takes this rank's share of one MoE block's `experts`, with per-expert LoRA
    when `lora.train_experts` (frozen experts without `lora`). `fused_kernel`: the local experts run kernels.moe's
    grouped GEMMs, else a per-expert loop (see experts.compute)."""
    rank = lora.rank if lora is not None and lora.train_experts else 0
    cls = trainable_experts_class() if rank else ExpertParallelExperts
    activation = family.expert_activation(experts) if family.expert_activation else None
    return cls(experts, placement, rank, lora.alpha if lora is not None else 1.0, fused_kernel, activation)


def parallelize(model, family: Family, placement: ExpertPlacement, lora: LoraSpec | None,
                fused_kernel: bool = True) -> int:
    """Replaces the routed experts of every MoE block of `model` by `expert_parallel`; returns how many blocks
    changed."""
    blocks = list(family.moe_blocks(model))
    for _, block in blocks:
        setattr(block, family.experts, expert_parallel(getattr(block, family.experts), family, placement, lora,
                                                       fused_kernel))
    return len(blocks)
