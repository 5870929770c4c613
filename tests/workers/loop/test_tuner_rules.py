"""The tuner's decision rules, the CPU memory measure, and what a job spec may say about micro-batches."""

import pytest
import torch

from moetune.api.models.base import SpecError
from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.workers.loop.tuner import MemoryProbe, MicroBatchTuner


def test_grows_one_divisor_at_a_time_to_the_largest_size_that_fits():
    tuner = MicroBatchTuner(per_rank=8, seq_len=10, budget_bytes=45.0)  # predicted(m) = 10 m at 1 byte/token
    reasons = [tuner.after_step(fixed=0.0, per_token=1.0) for _ in range(4)]
    assert reasons == ["grow", "grow", None, None] and tuner.size == 4  # 8 would need 80


def test_a_dpo_pair_is_predicted_as_its_two_sequences():
    """per_token is measured over all the micro-batch's tokens, chosen and rejected answers both: a size of m pairs
    holds 2 m sequences."""
    tuner = MicroBatchTuner(per_rank=8, seq_len=10, budget_bytes=45.0, sequences=2)  # predicted(m) = 20 m
    assert tuner.predicted(2, fixed=0.0, per_token=1.0) == 40.0
    while tuner.after_step(fixed=0.0, per_token=1.0):
        pass
    assert tuner.size == 2  # 4 pairs would need 80


def test_shrinks_when_the_measure_no_longer_fits_and_counts_the_fixed_part():
    tuner = MicroBatchTuner(per_rank=8, seq_len=10, budget_bytes=45.0, size=4)
    assert tuner.after_step(fixed=0.0, per_token=1.5) == "shrink" and tuner.size == 2  # 60 > 45 >= 30
    assert tuner.after_step(fixed=40.0, per_token=1.0) == "shrink" and tuner.size == 1  # 40 + 20 > 45
    assert tuner.after_step(fixed=50.0, per_token=1.0) is None and tuner.size == 1  # nothing smaller exists


def test_an_oom_halves_the_size_and_caps_it_below_the_failed_one():
    tuner = MicroBatchTuner(per_rank=12, seq_len=1, budget_bytes=None, size=6)
    tuner.back_off()
    assert (tuner.size, tuner.ceiling) == (3, 4)
    assert [tuner.after_step(0.0, 1.0) for _ in range(3)] == ["grow", None, None] and tuner.size == 4
    tuner.back_off()
    tuner.back_off()
    assert (tuner.size, tuner.ceiling) == (1, 1)


def test_state_restores_the_size_and_the_oom_ceiling_only_for_the_same_batch_split():
    tuner = MicroBatchTuner(per_rank=12, seq_len=1, budget_bytes=None, size=6)
    tuner.back_off()
    resumed = MicroBatchTuner(per_rank=12, seq_len=1, budget_bytes=None)
    assert resumed.restore(**tuner.state()) and (resumed.size, resumed.ceiling) == (3, 4)
    assert [resumed.after_step(0.0, 1.0) for _ in range(2)] == ["grow", None]  # the OOM is not forgotten
    other_split = MicroBatchTuner(per_rank=8, seq_len=1, budget_bytes=None)
    assert not other_split.restore(**tuner.state()) and (other_split.size, other_split.ceiling) == (1, 8)


def test_a_size_that_failed_outside_the_loop_is_never_used_again():
    tuner = MicroBatchTuner(per_rank=12, seq_len=1, budget_bytes=None, size=6)
    tuner.exclude_from(6)
    assert (tuner.size, tuner.ceiling) == (4, 4)
    tuner.exclude_from(12)  # a larger failure tells nothing new
    assert (tuner.size, tuner.ceiling) == (4, 4)
    assert tuner.after_step(0.0, 1.0) is None


def test_without_a_budget_it_grows_to_the_whole_per_rank_batch():
    tuner = MicroBatchTuner(per_rank=8, seq_len=512, budget_bytes=None)
    while tuner.after_step(fixed=1e12, per_token=1e9):
        pass
    assert tuner.size == 8


def test_cpu_measure_counts_saved_activations_once_and_never_parameters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    probe = MemoryProbe(model, torch.device("cpu"))
    measured = []
    for batch in (2, 4):
        probe.begin()
        loss = model(torch.randn(batch, 16)).sum()
        probe.end()
        loss.backward()
        measured.append(probe.activation)
    # saved: the input (for the first weight's grad) and the ReLU output (ReLU's backward and the second
    # weight's grad share it); the second layer's weight is saved too but is a parameter
    assert measured == [2 * batch * 16 * 4 for batch in (2, 4)]


BASE = {"model": "s3://models/tiny", "training_file": "s3://data/train.jsonl"}


def test_auto_spec_rules():
    auto = resolve_run_config(JobCreate.model_validate({**BASE, "training": {
        "micro_batch_size": "auto", "memory_budget_mb": 1.5, "global_batch_size": 6},
        "parallelism": {"num_workers": 2}}), 0)
    t = auto.training  # tuned from 1: the run config holds the start, the tuner the live size
    assert (t.tune_micro_batch, t.micro_batch_size, t.memory_budget_mb) == (True, 1, 1.5)
    for fields, param in (
        ({"training": {"micro_batch_size": "auto", "global_batch_size": 5}, "parallelism": {"num_workers": 2}},
         "training.global_batch_size"),
        ({"training": {"micro_batch_size": 2, "memory_budget_mb": 100}}, "training.memory_budget_mb"),
    ):
        with pytest.raises(SpecError) as err:
            resolve_run_config(JobCreate.model_validate({**BASE, **fields}), 0)
        assert err.value.param == param
    with pytest.raises(ValueError, match="must be >= 1 or \"auto\""):
        JobCreate.model_validate({**BASE, "training": {"micro_batch_size": 0}})
