"""Fixtures of the worker tests: the tiny checkpoint on disk."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    from moetune.workers.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-model")), seed=0)
