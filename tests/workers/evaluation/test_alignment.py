"""The precision alignment at job start, in process on the tiny glm5_next (KDA + sparse attention + expert-parallel
experts), and on each rank's slice of its CP forward: every swapped operator is reached and matches its reference;
a perturbed operator is named."""

from __future__ import annotations

import pytest
import torch

import moetune.workers.families.kda as kda_module
from moetune.api.models.lora import LoraSpec
from moetune.api.models.training import TrainingSpec
from moetune.kernels.kda import chunk_kda
from moetune.api.environment import ENV_PERTURB_OP
from moetune.workers.evaluation.alignment import FIRST_LOSS, check_alignment, verdict
from moetune.workers.families import REGISTRY, apply_kernel_swaps
from moetune.workers.model import trainable_model
from moetune.workers.experts.compute import fused_expert_forward
from moetune.workers.experts.module import ExpertParallelExperts
from moetune.workers.experts.placement import placement_at
from bench.support.tiny_models import batch, plain_model

def failed_ops(rows: list[dict]) -> list[str]:
    return [row["op"] for row in rows if not row["ok"]]


LORA = LoraSpec(rank=4, alpha=8, dropout=0.0, train_experts=True)


@pytest.fixture(scope="module")
def swapped():
    model = plain_model(REGISTRY["glm5_next"])
    assert all(apply_kernel_swaps(model).values())
    torch.manual_seed(1)
    model = trainable_model(model, LORA, TrainingSpec(), placement_at(model.config.to_dict(), 1, 0)).eval()
    inputs = batch(0, 0, seq=40, vocab=272)
    return model, lambda: model(**inputs).loss


def test_every_swapped_operator_matches_its_reference(swapped):
    model, loss = swapped
    rows = check_alignment(model, loss, torch.float32)
    assert [r["op"] for r in rows] == ["kda", "sparse_attention", "experts", FIRST_LOSS]
    assert failed_ops(rows) == [], rows
    assert all(0 <= r["rmse_ratio"] < 1e-4 for r in rows[:-1]), rows  # measured, not trivially zero
    assert verdict(rows, True, 0.5)[::2] == ("info", None)
    # the check leaves the model's operators as it found them
    assert kda_module.chunk_kda is chunk_kda
    assert all(m.compute is fused_expert_forward for m in model.modules() if isinstance(m, ExpertParallelExperts))


@pytest.mark.parametrize("op", ["kda", "experts"])
def test_a_perturbed_operator_is_named(swapped, monkeypatch, op):
    model, loss = swapped
    monkeypatch.setenv(ENV_PERTURB_OP, op)
    rows = check_alignment(model, loss, torch.float32)
    assert [name for name in failed_ops(rows) if name != FIRST_LOSS] == [op], rows

    # alignment_check true: the job fails naming the operator; "warn": a warning only
    level, message, error = verdict(rows, True, 0.5)
    assert level == "error" and error.code == "alignment_failed" and error.param == "training.alignment_check"
    assert f"Precision alignment failed for {op}" in error.message and op in message
    level, message, error = verdict(rows, "warn", 0.5)
    assert level == "warn" and error is None and op in message


def test_a_quantized_linear_is_compared_with_its_dequantized_weight(monkeypatch):
    from moetune.kernels.moe.linear import QuantizedLinear
    from moetune.kernels.quant import quantize_fp8_block

    torch.manual_seed(0)
    layer = QuantizedLinear(quantize_fp8_block(torch.randn(256, 128)), None)
    x = torch.randn(4, 128)
    rows = check_alignment(layer, lambda: layer(x).square().mean(), torch.float32)
    assert [r["op"] for r in rows] == ["quantized_linear", FIRST_LOSS] and failed_ops(rows) == [], rows
    monkeypatch.setenv(ENV_PERTURB_OP, "quantized_linear")
    assert failed_ops(check_alignment(layer, lambda: layer(x).square().mean(), torch.float32)) == [
        "quantized_linear", FIRST_LOSS]


def test_gated_deltanet_is_compared_with_its_reference(monkeypatch):
    """qwen3_next's swapped Gated DeltaNet core (one decay per head) against the recurrent oracle, and named when
    perturbed."""
    model = plain_model(REGISTRY["qwen3_next"])
    assert apply_kernel_swaps(model) == {"apply_kda_kernels": 3}
    inputs = batch(0, 0, seq=40, vocab=272)
    rows = check_alignment(model, lambda: model(**inputs).loss, torch.float32)
    assert [r["op"] for r in rows] == ["gated_delta", FIRST_LOSS] and failed_ops(rows) == [], rows
    assert 0 <= rows[0]["rmse_ratio"] < 1e-4
    monkeypatch.setenv(ENV_PERTURB_OP, "gated_delta")
    assert "gated_delta" in failed_ops(check_alignment(model, lambda: model(**inputs).loss, torch.float32))


def _check_a_slice(rank: int, world: int, out_dir: str) -> None:
    from moetune.kernels.kda.context_slices import SliceLayout
    from moetune.workers.families.context import context_parallel

    config = REGISTRY["glm5_next"].tiny_config()
    config.use_cache = config.get_text_config().use_cache = False  # as a training job's model
    model = plain_model(REGISTRY["glm5_next"], config=config)
    apply_kernel_swaps(model)
    ids = batch(0, 0, seq=40, vocab=272)["input_ids"]
    layout = SliceLayout.even(40, world, rank)
    part = {"input_ids": ids[:, layout.start:layout.end],
            "position_ids": torch.arange(layout.start, layout.end).expand(ids.shape[0], -1)}
    with context_parallel(model, layout):
        rows = check_alignment(model, lambda: model(**part).logits.square().mean(), torch.float32)
    torch.save(rows, f"{out_dir}/rank{rank}.pt")


def test_a_context_parallel_rank_checks_its_slice(tmp_path):
    """At context_parallel_size 2 each rank checks the operators of its slice's CP forward: the KDA runs that carry
    the state across the ranks and the sparse attention over the gathered keys, against the same references."""
    from bench.support.harness import launch

    launch(_check_a_slice, 2, str(tmp_path))
    for rank in range(2):
        rows = torch.load(tmp_path / f"rank{rank}.pt")
        assert [r["op"] for r in rows] == ["kda", "sparse_attention", FIRST_LOSS] and failed_ops(rows) == [], rows
        assert all(0 <= r["rmse_ratio"] < 1e-4 for r in rows[:-1]), rows
