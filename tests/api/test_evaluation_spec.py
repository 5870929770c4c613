"""The `evaluation` section and `training.select_checkpoint` at submission: 422s naming what is wrong."""

import pytest
from pydantic import ValidationError

from moetune.api.models.job_create import JobCreate

BASE = {"model": "s3://m/model", "training_file": "s3://m/train.jsonl"}
EVALUATION = {"file": "s3://m/eval.jsonl", "metrics": ["exact_match", "rouge_l"]}


@pytest.mark.parametrize("fields, names", [
    ({"evaluation": {**EVALUATION, "metrics": ["bleu"]}}, "evaluation.metrics.0"),
    ({"evaluation": {**EVALUATION, "metrics": []}}, "evaluation.metrics"),
    ({"evaluation": {**EVALUATION, "file": "eval.jsonl"}}, "evaluation.file"),
    ({"training": {"select_checkpoint": "best"}}, "training.select_checkpoint"),
    ({"training": {"select_checkpoint": "best:chrf", "checkpoint_every": 2}, "evaluation": EVALUATION},
     "needs evaluation.metrics to include 'chrf'"),
    ({"training": {"select_checkpoint": "best:rouge_l"}, "evaluation": EVALUATION}, "needs training.checkpoint_every"),
])
def test_bad_evaluation_specs_are_refused_naming_the_field(fields, names):
    with pytest.raises(ValidationError) as refused:
        JobCreate.model_validate({**BASE, **fields})
    assert names in str(refused.value)


def test_best_checkpoint_of_an_evaluated_metric_is_accepted():
    spec = JobCreate.model_validate({**BASE, "evaluation": EVALUATION,
                                     "training": {"select_checkpoint": "best:rouge_l", "checkpoint_every": 4}})
    assert spec.training.select_checkpoint == "best:rouge_l" and spec.evaluation.max_new_tokens == 64
