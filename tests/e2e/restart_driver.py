"""A light Ray job driver for the control-plane restart test: it reports like workers/driver.py but trains
nothing, so several jobs fit on the test machine at once.

It waits for `<output_uri>/go` (the test writes it), then fails when its training file's name contains
"fail", else writes the job's summary.json and reports success. Unlike a real driver, which waits up to
15 minutes for the control plane to take its reports, it gives up on an undelivered result after a few seconds and
ends: a driver that dies with its result unsent, which the restarted control plane must still account for (from
Ray's status and the job's summary.json).
"""

import json
import os
import sys
import time

import s3fs

from moetune.api.environment import ENV_RUN_SPEC, ENV_S3_ENDPOINT_URL
from moetune.api.errors import ErrorCode
from moetune.api.layout import SUMMARY_FILE, result_from_summary
from moetune.api.models.job_run import JobRunSpec
from moetune.workers.reporting.reporter import Reporter
from moetune.workers.settings import WorkerSettings

TRAINED_TOKENS = 42


def main() -> int:
    run = JobRunSpec.model_validate_json(os.environ[ENV_RUN_SPEC])
    settings = WorkerSettings()
    reporter = Reporter(run.job_id, settings.callback_url, settings.job_token, flush_timeout_s=3)
    reporter.event("restart driver started")
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ[ENV_S3_ENDPOINT_URL]}, use_listings_cache=False)
    out = run.output_uri.removeprefix("s3://")
    deadline = time.monotonic() + 600
    while not fs.exists(f"{out}/go") and time.monotonic() < deadline:
        time.sleep(0.3)
    if "fail" in run.config.training_file:
        reporter.failed(ErrorCode.training_failed, "the training file asks this job to fail")
        reporter.close()  # its word on what it could not deliver comes before the line below
        print("restart driver: the training file asks this job to fail", file=sys.stderr)  # Ray's last log line
        return 1
    summary = {"trained_tokens": TRAINED_TOKENS}
    fs.pipe(f"{out}/{SUMMARY_FILE}", json.dumps(summary).encode())
    reporter.send(result_from_summary(run.output_uri, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
