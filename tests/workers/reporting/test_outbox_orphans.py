"""A reporting process that dies with reports unsent (a worker killed during a control-plane outage) leaves them in its
outbox file; the job's next reporting process on the node sends them first."""

import subprocess
import sys

from moetune.service.local.embedded import free_port
from moetune.workers.reporting.reporter import Reporter

DIES_WITH_REPORTS_UNSENT = """
import os, sys
from moetune.workers.reporting.reporter import Reporter
reporter = Reporter("ftjob-1", sys.argv[1], "t", directory=sys.argv[2])
for step in (1, 2, 3):
    reporter.metrics(step, train_loss=1.0)
os._exit(0)
"""


def test_the_next_process_sends_what_a_dead_one_left(receiver, tmp_path):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    subprocess.run([sys.executable, "-c", DIES_WITH_REPORTS_UNSENT, down, str(tmp_path)], check=True, timeout=60)
    reporter = Reporter("ftjob-1", receiver.url, "t", directory=tmp_path)
    assert reporter.metrics(4, train_loss=1.0)
    assert [m["step"] for m in receiver.metrics()] == [1, 2, 3, 4]
    assert reporter.close() and not list(tmp_path.iterdir())  # the orphan's file went once it was sent
