"""The wire contract: what a job spec may say, and how resolve_run_config names the offending field."""

import pytest
from pydantic import ValidationError

from moetune.api.models.base import SpecError
from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config

BASE = {"model": "s3://models/tiny", "training_file": "s3://data/train.jsonl"}


def spec(**fields) -> JobCreate:
    return JobCreate.model_validate({**BASE, **fields})


def test_defaults_resolve_to_one_epoch():
    resolved = resolve_run_config(spec(), 0)
    assert resolved.training.n_epochs == 1 and resolved.training.max_steps is None
    assert resolved.lora.rank == 16 and resolved.parallelism.zero_stage == 2


def test_openai_hyperparameters_override_training():
    resolved = resolve_run_config(spec(hyperparameters={"batch_size": 16, "learning_rate_multiplier": 2.0,
                                                        "n_epochs": 3}, training={"global_batch_size": 4}), 0)
    assert resolved.training.global_batch_size == 16
    assert resolved.training.learning_rate == pytest.approx(2e-4)
    assert (resolved.training.n_epochs, resolved.training.max_steps) == (3, None)
    with pytest.raises(SpecError) as err:  # never silently drop one of the two lengths
        resolve_run_config(spec(hyperparameters={"n_epochs": 3}, training={"max_steps": 10}), 0)
    assert err.value.param == "hyperparameters.n_epochs" and "not both" in str(err.value)


@pytest.mark.parametrize("fields, param", [
    ({"training": {"global_batch_size": 6, "micro_batch_size": 2}, "parallelism": {"num_workers": 2}},
     "training.global_batch_size"),
    ({"training": {"global_batch_size": 8}, "parallelism": {"num_workers": 4, "expert_parallel_size": 3}},
     "parallelism.expert_parallel_size"),
    ({"parallelism": {"num_workers": 2, "gpus_per_worker": 4}}, "parallelism.gpus_per_worker"),
])
def test_inconsistent_specs_name_the_field(fields, param):
    with pytest.raises(SpecError) as err:
        resolve_run_config(spec(**fields), 0)
    assert err.value.param == param


@pytest.mark.parametrize("fields, loc", [
    ({"model": "https://example.com/model"}, ("model",)),
    ({"training_file": "/local/train.jsonl"}, ("training_file",)),
    ({"training": {"learning_rat": 0.1}}, ("training", "learning_rat")),
    ({"lora": {"rank": 0}}, ("lora", "rank")),
    ({"suffix": "no spaces"}, ("suffix",)),
    ({"training": {"max_steps": 5, "n_epochs": 2}}, ("training",)),
])
def test_invalid_fields_are_rejected_with_their_location(fields, loc):
    with pytest.raises(ValidationError) as err:
        spec(**fields)
    assert err.value.errors()[0]["loc"] == loc
