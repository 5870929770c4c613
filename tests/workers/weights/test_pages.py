"""workers.weights.pages: memory the loader populated takes no page fault when the bytes are written into it (the
point: no fault while the writing thread holds the GIL); fresh memory it did not populate takes one per page.
Fresh anonymous mappings, not torch.empty: an allocator may hand back memory a test before this one touched."""

import ctypes
import mmap
import resource
import sys

import numpy as np
import pytest

from moetune.workers.weights.pages import populate_for_write

SIZE = 64 * 2**20


def _faults_writing(memory: mmap.mmap) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.frombuffer(memory, np.uint8)[::4096] = 1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_WRITE is Linux's")
def test_populated_memory_takes_no_page_fault_on_write():
    fresh = mmap.mmap(-1, SIZE)
    assert _faults_writing(fresh) > SIZE // 4096 // 2
    populated = mmap.mmap(-1, SIZE)
    assert populate_for_write(ctypes.addressof(ctypes.c_char.from_buffer(populated)), SIZE)
    assert _faults_writing(populated) < 16  # the partial pages at both ends, at most
