"""The one builder (workers.model.build_model): a quantized base runs as built, without a step of training having
wrapped it (serving builds no LoRA; a job at EP=1 without expert LoRA asks for no expert module), and gives
transformers' own dequantized logits; the planner's meta model is the job's model, module for module."""

from __future__ import annotations

import pytest
import torch

from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.kernels.quant import held_names
from moetune.workers.families import REGISTRY
from moetune.workers.model import META, SERVE, TRAIN, WeightsSource, build_model
from moetune.workers.experts.module import ExpertParallelExperts
from bench.support.tiny_models import batch, plain_model
from bench.support.quantized import FAMILY_OF, dequantized_reference, quantize_checkpoint

CPU = torch.device("cpu")
SPEC = resolve_run_config(JobCreate(model="file:///unused", training_file="file:///unused.jsonl",
                                    lora={"rank": 4, "alpha": 8, "dropout": 0.0}), 0)


def _config(path: str) -> dict:
    import json

    with open(f"{path}/config.json") as f:
        return json.load(f)


@pytest.fixture(scope="module", params=["fp8", "mxfp4"])
def quantized(request, tmp_path_factory) -> tuple[str, str]:
    fmt = request.param
    dense = str(tmp_path_factory.mktemp(f"dense-{fmt}"))
    plain_model(REGISTRY[FAMILY_OF[fmt]]).save_pretrained(dense, max_shard_size="100KB")
    return fmt, quantize_checkpoint(dense, str(tmp_path_factory.mktemp(fmt)), fmt)


@pytest.mark.parametrize("mode", [SERVE, TRAIN])
def test_a_quantized_base_runs_as_built_and_gives_the_dequantized_logits(quantized, mode):
    fmt, path = quantized
    torch.manual_seed(1)
    built = build_model(mode, _config(path), SPEC if mode == TRAIN else None, device=CPU,
                        weights=WeightsSource(f"file://{path}"))
    ids = batch(0, 0, vocab=272)["input_ids"]
    with torch.no_grad():  # LoRA B = 0 (train): the base model's logits
        torch.testing.assert_close(built.model(input_ids=ids).logits,
                                   dequantized_reference(fmt, path)(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    experts = [getattr(block, built.family.experts) for _, block in built.family.moe_blocks(built.model)]
    assert experts and all(isinstance(e, ExpertParallelExperts) and held_names(e) for e in experts)  # kept quantized
    assert any(p.requires_grad for p in built.model.parameters()) == (mode == TRAIN)


def test_the_planners_meta_model_is_the_jobs_model_module_for_module(tmp_path):
    """Same kernel swaps, same LoRA, in the same places; only the routed experts differ (stand-ins on meta)."""
    family = REGISTRY["kimi_linear"]
    plain_model(family).save_pretrained(str(tmp_path), max_shard_size="100KB")
    config = _config(str(tmp_path))
    job = build_model(TRAIN, config, SPEC, device=CPU, weights=WeightsSource(f"file://{tmp_path}"))
    meta = build_model(META, config, SPEC, dtype=torch.float32)
    assert job.swapped == meta.swapped and all(job.swapped.values())

    def layout(model):
        return {name: type(m).__name__ for name, m in model.named_modules() if f".{family.experts}" not in name}

    assert layout(job.model) == layout(meta.model)
    assert {n for n, p in job.model.named_parameters() if p.requires_grad} == {
        n for n, p in meta.model.named_parameters() if p.requires_grad}
