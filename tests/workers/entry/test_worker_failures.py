"""The controller-side callback: a lost worker becomes a job event; a user error stops the run without restarts."""

import pytest

from moetune.workers.errors import DatasetError
from moetune.workers.reporting.reporter import Reporter
from moetune.workers.entry.failures import ReportWorkerFailures


def test_failures_are_reported_and_user_errors_are_not_retried(receiver):
    callback = ReportWorkerFailures(Reporter("ftjob-1", callback_url=receiver.url, token="t"), max_failures=1)
    lost = RuntimeError("The actor died unexpectedly before finishing this task.")
    callback.after_exception(None, {1: lost})
    callback.after_exception(None, {0: RuntimeError("gloo: Connection reset by peer"), 1: lost})
    first, second = receiver.of_kind("event")
    assert first.level == "warn" and first.message == (
        "Worker failure 1 (rank 1): RuntimeError: The actor died unexpectedly before finishing this task.; "
        "restarting the worker group from the newest complete checkpoint")
    assert second.message.startswith("Worker failure 2 (rank 0, 1): RuntimeError: gloo")
    assert second.message.endswith("; no restarts left") and second.data["ranks"] == [0, 1]

    bad_data = DatasetError("training_file", "row 2: bad")
    with pytest.raises(DatasetError) as raised:
        callback.after_exception(None, {0: RuntimeError("peer gone"), 1: bad_data})
    assert raised.value is bad_data and len(receiver.of_kind("event")) == 2
