"""MoE series of one worker: its all-to-all traffic per layer and (rank 0) the job's expert load per layer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from moetune.workers.reporting.expert_load import (
    HOT_EXPERTS,
    ExpertLoad,
    LoadRatioHistogram,
    layer_stats,
)


class MoEMetrics:
    def __init__(self, model, registry: CollectorRegistry, labels: dict[str, str], export_load: bool):
        self.load = ExpertLoad(model)
        self.base, self.export_load = list(labels.values()), export_load
        names = [*labels, "layer"]

        def counter(name, doc):
            return Counter(name, doc, names, registry=registry)

        def gauge(name, doc, *extra):
            return Gauge(name, doc, [*names, *extra], registry=registry)

        self.a2a_bytes = counter("moetune_alltoall_sent_bytes",
                                 "Token all-to-all bytes this rank sent to other ranks (forward and backward)")
        self.a2a_seconds = counter("moetune_alltoall_seconds", "Time this rank spent in token all-to-all exchanges")
        counters = [self.a2a_bytes, self.a2a_seconds]
        if export_load:
            self.routed = counter("moetune_moe_routed_tokens", "Token-to-expert assignments (a token counts once "
                                                               "per chosen expert), all ranks")
            counters.append(self.routed)
        for layer in self.load.layers:  # counters start at 0 when training starts: rate() sees the first step
            for c in counters:
                c.labels(*self.base, layer)
        self.in_training: list[tuple[int, float]] | None = None  # each layer's exchanges before validation
        if not export_load:
            return
        self.histogram = LoadRatioHistogram(labels, self.load.layers)
        registry.register(self.histogram)
        self.imbalance = gauge("moetune_moe_load_imbalance_ratio", "Max over mean expert load in the last step")
        self.cv = gauge("moetune_moe_load_cv", "Coefficient of variation of the expert loads in the last step")
        self.aux_loss = gauge("moetune_moe_aux_loss", "Balance loss E*sum(f_i*P_i) of the last step (1 = balanced)")
        self.hot = gauge("moetune_moe_hot_expert_load_ratio", "Load over mean load of the layer's most loaded "
                                                              "experts in the last step", "expert")
        self.hot_shown: dict[str, list[str]] = {}

    def training_part_done(self) -> None:
        """Between a step's training and its validation: the step's all-to-all seconds are its training's (the
        report's share is of training time); the counters take both."""
        self.in_training = [module.comm.drain() for module in self.load.modules]

    def step_end(self) -> dict:
        """Every rank: its traffic, then the collective load sum; rank 0 exports the load. Returns the step's
        figures for the adaptation report: this rank's all-to-all seconds in training and (rank 0) each layer's
        imbalance."""
        total_seconds = 0.0
        after = [module.comm.drain() for module in self.load.modules]  # the validation's, once training's is taken
        training, self.in_training = self.in_training, None
        if training is None:  # not split: all of it is training's
            training, after = after, [(0, 0.0)] * len(after)
        for layer, (sent, seconds), (after_sent, after_seconds) in zip(self.load.layers, training, after):
            total_seconds += seconds
            self.a2a_bytes.labels(*self.base, layer).inc(sent + after_sent)
            self.a2a_seconds.labels(*self.base, layer).inc(seconds + after_seconds)
        figures = {"alltoall_seconds": total_seconds}
        if not self.load.layers:
            return figures
        counts, weights = self.load.step_totals()
        if not self.export_load:
            return figures
        stats = layer_stats(counts, weights, self.load.top_k)
        self.histogram.observe(stats["ratios"])
        hottest = stats["ratios"].topk(min(HOT_EXPERTS, counts.shape[1]), dim=1)
        for i, layer in enumerate(self.load.layers):
            at = (*self.base, layer)
            self.routed.labels(*at).inc(float(stats["assignments"][i]))
            self.imbalance.labels(*at).set(float(stats["imbalance"][i]))
            self.cv.labels(*at).set(float(stats["cv"][i]))
            self.aux_loss.labels(*at).set(float(stats["aux_loss"][i]))
            for expert in self.hot_shown.get(layer, []):  # last step's hottest may have cooled down
                self.hot.remove(*at, expert)
            self.hot_shown[layer] = [str(e) for e in hottest.indices[i].tolist()]
            for expert, ratio in zip(self.hot_shown[layer], hottest.values[i].tolist()):
                self.hot.labels(*at, expert).set(ratio)
        figures["expert_imbalance"] = dict(zip(self.load.layers, stats["imbalance"].tolist()))
        return figures
