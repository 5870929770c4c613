"""Routing statistics of every expert-parallel MoE layer, summed over all ranks once per step.

Cardinality: the seed model has hundreds of routed experts in each of dozens of layers, so no series is
labelled by expert except the few hottest. Per layer and job:
- `moetune_moe_routed_tokens_total`: token-to-expert assignments (a token counts once per chosen expert);
- `moetune_moe_expert_load_ratio` (histogram): each expert's step load divided by the layer's mean load, one
  observation per expert per step; its buckets over time are the layer's load heatmap;
- `moetune_moe_load_imbalance_ratio` (max/mean) and `moetune_moe_load_cv` (std/mean) of the last step;
- `moetune_moe_aux_loss`: the Switch/DeepSeek balance loss E·Σ f_i·P_i (α = 1) of the last step, with P_i from
  the routed top-k gate weights (the full router softmax never reaches the dispatch); 1 when balanced;
- `moetune_moe_hot_expert_load_ratio{expert}`: the HOT_EXPERTS most loaded experts of the last step.
That is len(LOAD_RATIO_BUCKETS) + 6 + HOT_EXPERTS series per layer (21 at the defaults), whatever the
number of experts; only rank 0 exports them (the numbers are global).
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from moetune.workers.comm import checked
from moetune.workers.experts.module import ExpertParallelExperts
from moetune.workers.recompute import recomputing


HOT_EXPERTS = 4
LOAD_RATIO_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.1, 1.5, 2.0, 4.0, 8.0, math.inf)


def layer_label(module_name: str, position: int) -> str:
    """The decoder layer index in the module path ("...layers.12.mlp.experts" -> "12")."""
    found = re.search(r"layers\.(\d+)\.", module_name)
    return found.group(1) if found else str(position)


class ExpertLoad:
    """Counts routed tokens and gate weights per (layer, expert) with forward hooks on the training forwards."""

    def __init__(self, model: torch.nn.Module):
        found = [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)]
        self.layers = [layer_label(name, i) for i, (name, _) in enumerate(found)]
        self.modules = [m for _, m in found]
        self.top_k = 1  # experts per token, seen in the first forward
        num_experts = max((m.num_experts for m in self.modules), default=0)
        # where the counts are made: where the rank's layers are (a pipeline stage's; the others' stay on meta)
        device = next((m.device for m in self.modules if m.device.type != "meta"), torch.device("cpu"))
        # [counts | gate weights] per layer; float64 keeps token counts exact through the all-reduce.
        self.totals = torch.zeros(2, len(found), num_experts, dtype=torch.float64, device=device)
        for i, module in enumerate(self.modules):
            module.register_forward_hook(self._hook(i), with_kwargs=True)

    def _hook(self, layer: int):
        def record(module, args, kwargs, output):
            if not module.training or recomputing():  # neither evaluation nor a checkpoint's rerun is load
                return
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]
            self.top_k, flat = index.shape[-1], index.reshape(-1)
            # the dispatch's own counts: a bincount here would read the largest index back to the host on CUDA
            self.totals[0, layer, : module.num_experts] += module.tokens_per_expert
            self.totals[1, layer].index_add_(0, flat, weights.reshape(-1).to(torch.float64).detach())

        return record

    def step_totals(self) -> torch.Tensor:
        """(counts, gate weights) [2, layers, experts] of the step over every rank; a collective: call on all."""
        totals = self.totals.clone()
        self.totals.zero_()
        if dist.is_initialized():
            checked.all_reduce(totals)
        return totals.cpu()


class LoadRatioHistogram(Collector):
    """`moetune_moe_expert_load_ratio` for every layer, accumulated in bulk (prometheus_client's Histogram
    would take one Python call per expert)."""

    def __init__(self, labels: dict[str, str], layers: list[str]):
        self.names, self.values, self.layers = [*labels, "layer"], list(labels.values()), layers
        # on the host: step_totals hands over the step's totals there, once per step
        self.bounds = torch.tensor(LOAD_RATIO_BUCKETS, dtype=torch.float64, device="cpu")
        self.cumulative = torch.zeros(len(layers), len(LOAD_RATIO_BUCKETS), dtype=torch.long, device="cpu")
        self.sums = torch.zeros(len(layers), dtype=torch.float64, device="cpu")

    def observe(self, ratios: torch.Tensor) -> None:
        """ratios: [layers, experts], each expert's load / its layer's mean load."""
        self.cumulative += (ratios.unsqueeze(-1) <= self.bounds).sum(1)
        self.sums += ratios.sum(1)

    def collect(self):
        h = HistogramMetricFamily("moetune_moe_expert_load_ratio",
                                  "Experts' per-step load divided by their layer's mean load", labels=self.names)
        for i, layer in enumerate(self.layers):
            buckets = [(_le(b), int(n)) for b, n in zip(LOAD_RATIO_BUCKETS, self.cumulative[i].tolist())]
            h.add_metric([*self.values, layer], buckets, float(self.sums[i]))
        yield h


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


def layer_stats(counts: torch.Tensor, weights: torch.Tensor, top_k: int) -> dict[str, torch.Tensor]:
    """Per-layer step statistics from [layers, experts] routed counts and gate-weight sums."""
    num_experts = counts.shape[1]
    mean = counts.mean(1, keepdim=True).clamp_min(1e-12)
    tokens = (counts.sum(1, keepdim=True) / top_k).clamp_min(1e-12)
    f = num_experts * counts / (top_k * tokens)  # 1 per expert when balanced
    p = weights / weights.sum(1, keepdim=True).clamp_min(1e-12)
    return {"ratios": counts / mean, "imbalance": (counts.amax(1, keepdim=True) / mean).squeeze(1),
            "cv": (counts.std(1, correction=0, keepdim=True) / mean).squeeze(1), "aux_loss": (f * p).sum(1),
            "assignments": counts.sum(1)}
