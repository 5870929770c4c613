"""micro_batch_size "auto" on ranks with different memory (harness.run_tuner_start, in the shared two-process
start): each rank plans its own first size from what its memory leaves, and all start at the smallest, so that
every rank runs the same number of micro-batches (a rank with one more would wait alone in the experts' all-to-all
or ZeRO's reductions)."""

import pytest

from tests.workers.experts.cases import TUNER_START_CASES


@pytest.mark.parametrize("case", list(TUNER_START_CASES))
def test_ranks_with_different_memory_start_at_the_same_micro_batch_size(ep_runs, case):
    _, ranks = ep_runs(case)
    assert [r["own"] for r in ranks] == [8, 2]  # what each rank's own memory would start it at
    assert [(r["start"], r["deepspeed"]) for r in ranks] == [(2, 2), (2, 2)]
