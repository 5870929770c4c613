"""Valid but absurd values are refused or warned about at submission, against the real training file in S3."""

from __future__ import annotations

import boto3
import pytest

JOBS = "/v1/fine_tuning/jobs"


@pytest.fixture(scope="module")
def ten_rows(service, s3_endpoint) -> str:
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="limits-data")
    s3.put_object(Bucket="limits-data", Key="ten.jsonl", Body="\n".join(['{"text": "a row"}'] * 10) + "\n\n")
    return "s3://limits-data/ten.jsonl"


def _create(service, training_file: str, **training):
    return service.http().post(JOBS, json={"model": "s3://models/tiny", "training_file": training_file,
                                           "training": training})


def _messages(service, job_id: str) -> list[tuple[str, str]]:
    return [(e["level"], e["message"]) for e in service.http().get(f"{JOBS}/{job_id}/events").json()["data"]]


def test_max_steps_passing_over_the_data_too_often_is_a_422_unless_allowed(service, ten_rows):
    refused = _create(service, ten_rows, max_steps=10**12)
    error = refused.json()["error"]
    assert refused.status_code == 422 and error["param"] == "training.max_steps"
    assert "make 8e+11 passes over the 10 rows of training_file" in error["message"]
    assert "training.allow_many_epochs: true" in error["message"]

    allowed = _create(service, ten_rows, max_steps=10**12, allow_many_epochs=True)
    assert allowed.status_code == 200, allowed.text
    # ... and the job says what such a schedule does to the learning rate
    assert ("warn", "training.warmup_ratio: the warm-up lasts 30000000000 of 1000000000000 steps; step 1 runs at "
                    "a learning rate of 3.3e-15 (3.3e-11 x training.learning_rate)") in _messages(service,
                                                                                         allowed.json()["id"])


def test_a_sensible_job_passes_without_warnings(service, ten_rows):
    job = _create(service, ten_rows, max_steps=100)  # 80 passes: under the limit of 100
    assert job.status_code == 200, job.text
    assert [level for level, _ in _messages(service, job.json()["id"])] == ["info", "info"]


def test_a_warm_up_as_long_as_the_run_is_a_warning(service, ten_rows):
    job = _create(service, ten_rows, n_epochs=2, warmup_ratio=1.0).json()  # 2 steps of 8 rows per epoch
    assert ("warn", "training.warmup_ratio: the warm-up lasts all 4 steps: the learning rate never reaches "
                    "training.learning_rate (0.0001)") in _messages(service, job["id"])
