"""Fixtures of the worker tests: the tiny checkpoint on disk, and it with datasets in a fresh bucket."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    from moetune.workers.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-model")), seed=0)


@pytest.fixture
def assets(tiny_checkpoint, s3_bucket, tmp_path):
    """The tiny checkpoint and datasets in a fresh bucket; returns the bucket's base URI (the driver and the
    resume tests' jobs read `models/tiny`, `data/train.jsonl` and `data/valid.jsonl` there)."""
    from moetune.api import storage
    from moetune.workers.tiny import write_tiny_dataset

    base = f"s3://{s3_bucket}"
    storage.upload_dir(tiny_checkpoint, f"{base}/models/tiny")
    for name, rows, seed in (("train.jsonl", 160, 0), ("valid.jsonl", 16, 1)):
        write_tiny_dataset(str(tmp_path / name), rows, seed)
        storage.write_bytes(f"{base}/data/{name}", (tmp_path / name).read_bytes())
    return base
