"""A light Ray job driver for the control-plane restart test: it reports like workers/driver.py but trains
nothing, so several jobs fit on the test machine at once.

It waits for `<output_uri>/go` (the test writes it), then fails when its training file's name contains
"fail", else writes the job's summary.json and reports success. Reports it cannot deliver (the control
plane is down) are dropped after the Reporter's retries, as a real driver's would be.
"""

import json
import os
import sys
import time

import s3fs

from moetune.api.models import (
    ADAPTER_DIR,
    ENV_RUN_SPEC,
    ENV_S3_ENDPOINT_URL,
    METRICS_FILE,
    SUMMARY_FILE,
    JobRunSpec,
)
from moetune.workers.reporting.reporter import Reporter

TRAINED_TOKENS = 42


def main() -> int:
    run = JobRunSpec.model_validate_json(os.environ[ENV_RUN_SPEC])
    reporter = Reporter(run.job_id)
    reporter.event("restart driver started")
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ[ENV_S3_ENDPOINT_URL]}, use_listings_cache=False)
    out = run.output_uri.removeprefix("s3://")
    deadline = time.monotonic() + 600
    while not fs.exists(f"{out}/go") and time.monotonic() < deadline:
        time.sleep(0.3)
    if "fail" in run.spec.training_file:
        reporter.failed("training_failed", "the training file asks this job to fail")
        print("restart driver: the training file asks this job to fail", file=sys.stderr)  # Ray's last log line
        return 1
    fs.pipe(f"{out}/{SUMMARY_FILE}", json.dumps({"trained_tokens": TRAINED_TOKENS}).encode())
    reporter.succeeded(fine_tuned_model=f"{run.output_uri}/{ADAPTER_DIR}",
                       result_files=[f"{run.output_uri}/{METRICS_FILE}"], trained_tokens=TRAINED_TOKENS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
