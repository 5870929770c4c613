"""Every rank of an expert-parallel checkpoint plans from the names mapped once (plan.map_checkpoint): each rank's
plan is the one it makes mapping every name itself, and planning all ranks maps each name once. A tiny Kimi K3 in
the release's naming (per-expert MXFP4 weight_packed + weight_scale, bench/weights_plan.py's synthetic index; the
release size is that bench's)."""

import json
from collections import Counter

import pytest
import torch

from bench.weights_plan import RELEASE, release_index
from moetune.api.quantization import quantization_of
from moetune.workers.experts.placement import placement_at
from moetune.workers.families.kimi_k3.tiny import tiny_config
from moetune.workers.weights.loader import empty_model, plan_for
from moetune.workers.weights.mapping import NameMapper
from moetune.workers.weights.plan import map_checkpoint


class _Checkpoint:
    def __init__(self, tensors, quantization):
        self.tensors, self.quantization, self.manifest = tensors, quantization, None


@pytest.fixture(scope="module")
def tiny_release():
    release = json.loads(RELEASE.read_text())
    config = {**tiny_config().to_dict(), "quantization_config": release["quantization_config"]}
    model = empty_model(config, torch.float32)
    return config, model, _Checkpoint(release_index(model), quantization_of(config))


def test_every_rank_plans_from_one_mapping_as_from_its_own(tiny_release, monkeypatch):
    config, model, ckpt = tiny_release
    mapper = NameMapper(model)
    calls = Counter()
    target = mapper.target
    monkeypatch.setattr(mapper, "target", lambda key: calls.update(["target"]) or target(key))
    mapped = map_checkpoint(ckpt.tensors, mapper, ckpt.quantization)
    tensors = sum(map(len, ckpt.tensors.values()))
    assert calls["target"] == tensors  # each tensor mapped once, for every rank below
    experts = config["text_config"]["num_experts"]
    assert len(mapped.per_expert) == experts and len(mapped.common) + len(mapped.metadata) < tensors / 2
    for ep in (1, 2, experts):
        for rank in range(ep):
            placement = placement_at(config, ep, rank)
            own = plan_for(ckpt, model, placement)  # mapping every name for this rank
            shared = plan_for(ckpt, model, placement, mapped)
            assert shared.pieces == own.pieces and shared.storage == own.storage, (ep, rank)
            assert (shared.unexpected, shared.metadata) == (own.unexpected, own.metadata)
            routed = {p.tensor for p in shared.pieces if ".experts." in p.tensor}
            assert len(routed) == 6 * (experts // ep) * len({k.rsplit(".experts.", 1)[0] for k in routed}), (ep, rank)
    assert calls["target"] == tensors  # the ranks' shared plans mapped nothing again
