"""The tiny model and datasets in a fresh bucket, for jobs that resume."""

from __future__ import annotations

import os

import pytest

from workers import storage

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from workers.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-model")), seed=0)


@pytest.fixture
def job_files(tiny_model, s3_bucket, tmp_path) -> str:
    """Bucket base URI holding models/tiny, data/train.jsonl (64 rows) and data/valid.jsonl (16 rows)."""
    from workers.tiny import write_tiny_dataset

    base = f"s3://{s3_bucket}"
    storage.upload_dir(tiny_model, f"{base}/models/tiny")
    for name, rows, seed in (("train.jsonl", 64, 0), ("valid.jsonl", 16, 1)):
        write_tiny_dataset(str(tmp_path / name), rows, seed)
        storage.write_bytes(f"{base}/data/{name}", (tmp_path / name).read_bytes())
    return base
