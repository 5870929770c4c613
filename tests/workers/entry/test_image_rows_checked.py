"""The driver refuses, before any worker starts, a data row that is over seq_len once its images become image
tokens, naming the file, the row and the count. The count is the family's own image processor's (checked against
transformers' processors in tests/workers/methods/test_multimodal.py)."""

import json

import pytest

from moetune.api import storage
from moetune.api.models.job_create import JobCreate
from moetune.api.models.job_run import JobRunSpec
from moetune.workers.entry.checks import validate
from moetune.workers.errors import DatasetError
from moetune.workers.families import REGISTRY
from moetune.workers.settings import WorkerSettings
from moetune.workers.tiny import solid_png, write_tiny_multimodal_checkpoint
from tests.support.images import data_url, image_row
from tests.support.jobs import job_run


def test_a_row_over_seq_len_with_its_image_tokens_is_refused_with_its_number(s3_bucket, tmp_path):
    base = f"s3://{s3_bucket}"
    storage.upload_dir(write_tiny_multimodal_checkpoint(str(tmp_path / "vl"), REGISTRY["qwen3_5_moe"].tiny_config),
                       f"{base}/model")
    small, large = data_url(solid_png("red", 32)), data_url(solid_png("blue", 64))  # 1 and 4 image tokens
    rows = [image_row(small, question="colour?", answer="red"), {"text": "plain text"},
            image_row(large, large, question="colour?", answer="blue")]
    storage.write_bytes(f"{base}/train.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())

    def run(seq_len: int) -> JobRunSpec:
        spec = JobCreate(model=f"{base}/model", training_file=f"{base}/train.jsonl",
                         training={"seq_len": seq_len, "global_batch_size": 2})
        return job_run("ftjob-1", spec, 0, f"{base}/out/ftjob-1")

    with pytest.raises(DatasetError) as err:
        validate(run(24), WorkerSettings())
    assert err.value.message.startswith(f"training_file {base}/train.jsonl row 3: with 2 image(s) is ")
    tokens = int(err.value.message.split(" is ")[1].split()[0])
    assert tokens > 24 and err.value.message.endswith(
        "tokens with its image tokens, over training.seq_len 24; rows are never cut through an image")
    assert validate(run(tokens), WorkerSettings())[0] == 3  # it fits exactly at its count


def test_image_rows_of_a_context_parallel_job_are_refused_before_any_worker(s3_bucket, tmp_path):
    """What submission did not scan (a file too large, storage away) the driver refuses: context parallelism splits
    token rows, and Kimi K3's image rows would have to be split with their image tokens."""
    base = f"s3://{s3_bucket}"
    storage.upload_dir(write_tiny_multimodal_checkpoint(str(tmp_path / "k3"), REGISTRY["kimi_k3"].tiny_config),
                       f"{base}/model")
    rows = [{"text": "plain text"}, image_row(data_url(solid_png("red", 32)), question="colour?", answer="red")]
    storage.write_bytes(f"{base}/train.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    spec = JobCreate(model=f"{base}/model", training_file=f"{base}/train.jsonl", training={"global_batch_size": 2},
                     parallelism={"num_workers": 2, "context_parallel_size": 2})
    with pytest.raises(DatasetError) as err:
        validate(job_run("ftjob-1", spec, 0, f"{base}/out/ftjob-1"), WorkerSettings())
    assert err.value.message == (
        f"training_file {base}/train.jsonl row 2: 'messages[0].content[1].image_url.url' is an image, but a job with "
        "parallelism.context_parallel_size = 2 trains on text only (context parallelism splits token rows, not "
        "images); use context_parallel_size 1 for image rows")
