"""workers.weights.pages: memory the loader populated takes no page fault when the bytes are written into it (the
point: no fault while the writing thread holds the GIL); fresh memory it did not populate takes one per page."""

import resource
import sys

import pytest
import torch

from moetune.workers.weights.pages import populate_for_write

SIZE = 64 * 2**20


def _faults_writing(t: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.numpy()[::4096] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")
def test_populated_memory_takes_no_page_fault_on_write():
    fresh = torch.empty(SIZE, dtype=torch.uint8)
    assert _faults_writing(fresh) > SIZE // 4096 // 2
    populated = torch.empty(SIZE, dtype=torch.uint8)
    assert populate_for_write(populated.data_ptr(), populated.numel())
    assert _faults_writing(populated) < 16  # the partial pages at both ends, at most
