"""The Ray job's driver (`python -m moetune.workers.entry.driver`): checks the job, runs the Ray Train worker group,
and sends the control plane the final result.

Reads the JobRunSpec from MOETUNE_RUN_SPEC; reports go to MOETUNE_CALLBACK_URL with
MOETUNE_JOB_TOKEN. Exit code 0 when the job succeeded or paused, 1 when it failed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid

from moetune.api.models import (
    ENV_CALLBACK_URL,
    ENV_JOB_TOKEN,
    ENV_RUN_SPEC,
    ENV_S3_ENDPOINT_URL,
    JobRunSpec,
)
from moetune.api import storage
from moetune.workers.data.rows import load_rows
from moetune.workers.errors import JobError
from moetune.workers.lora.peft_lora import check_targets_on_config
from moetune.workers.reporting.metrics import METRICS_ENV
from moetune.workers.model import check_supported, read_remote_config
from moetune.workers.reporting.reporter import Reporter
from moetune.workers.checkpoints.run_state import (
    DEFAULT_MAX_WORKER_FAILURES,
    ENV_MAX_WORKER_FAILURES,
    paused_step,
)
from moetune.workers.loop.worker import ADAPTER_DIR, METRICS_FILE, SUMMARY_FILE

log = logging.getLogger("moetune.driver")

# What every worker needs from the driver's environment, whatever the cluster's own environment holds.
FORWARDED_ENV = (ENV_CALLBACK_URL, ENV_JOB_TOKEN, ENV_S3_ENDPOINT_URL, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION", "HF_HUB_OFFLINE", *METRICS_ENV)


def validate(run: JobRunSpec) -> int:
    """Fails fast, before any worker starts: returns the number of training rows."""
    spec = run.spec
    config = read_remote_config(spec.model)
    check_supported(spec, config)
    check_targets_on_config(config, spec.lora)
    rows = len(load_rows(spec.training_file, "training_file"))
    if spec.validation_file:
        load_rows(spec.validation_file, "validation_file")
    return rows


def _storage_for_ray(uri: str):
    """(storage_path, pyarrow filesystem or None) for Ray Train's run state under `uri`."""
    if uri.startswith("file://"):
        return uri[len("file://"):], None
    endpoint = os.environ.get(ENV_S3_ENDPOINT_URL)
    if uri.startswith("s3://") and endpoint:
        from pyarrow.fs import S3FileSystem

        scheme, _, host = endpoint.partition("://")
        return uri[len("s3://"):], S3FileSystem(endpoint_override=host, scheme=scheme)
    return uri, None


def max_worker_failures() -> int:
    """How many times Ray Train may restart a worker group that lost a worker (operator setting)."""
    return int(os.environ.get(ENV_MAX_WORKER_FAILURES, DEFAULT_MAX_WORKER_FAILURES))


def build_trainer(run: JobRunSpec, attempt: str, reporter: Reporter):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from moetune.workers.loop.worker import train_loop_per_worker
    from moetune.workers.entry.failures import ReportWorkerFailures

    par = run.spec.parallelism
    use_gpu = par.gpus_per_worker > 0
    resources = {"CPU": 1, "GPU": par.gpus_per_worker} if use_gpu else {"CPU": 1}
    storage_path, storage_fs = _storage_for_ray(storage.join(run.output_uri, "ray"))
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "run_spec": run.model_dump_json(),
            "threads": int(resources["CPU"]),  # torch threads = the worker's CPU share
            "worker_env": {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ},
            "attempt": attempt,
        },
        scaling_config=ScalingConfig(num_workers=par.num_workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=run.job_id,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            # A restarted group resumes from the newest complete checkpoint (workers.resume).
            failure_config=FailureConfig(max_failures=max_worker_failures()),
            callbacks=[ReportWorkerFailures(reporter, max_worker_failures())],
        ),
    )


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and every error behind it (Ray Train's worker and controller failures, causes), outermost first."""
    seen, chain, pending = set(), [], [error]
    while pending:
        e = pending.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        chain.append(e)
        pending += list(getattr(e, "worker_failures", {}).values())
        pending += [c for c in (getattr(e, "controller_failure", None), e.__cause__, e.__context__) if c]
    return chain


def job_error(error: BaseException) -> JobError | None:
    """The first JobError (a problem the user must fix) behind `error`, if any."""
    return next((e for e in _chain(error) if isinstance(e, JobError)), None)


def root_cause(error: BaseException) -> JobError:
    """The first JobError behind a Ray Train failure, or the innermost error in one line."""
    if found := job_error(error):
        return found
    innermost = _chain(error)[-1]
    text = str(innermost).strip().splitlines()
    message = f"{type(innermost).__name__}: {text[-1] if text else ''}".strip()
    return JobError("training_failed", message[:500])


def run_job(run: JobRunSpec, reporter: Reporter) -> bool:
    """Runs the whole job and sends its ResultReport; True on success or pause."""
    try:
        rows = validate(run)
        reporter.event(f"Files validated: {rows} training rows")
        import ray

        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING)
        par = run.spec.parallelism
        ep = f", expert parallel {par.expert_parallel_size}" if par.expert_parallel_size > 1 else ""
        reporter.event(f"Starting {par.num_workers} workers (ZeRO-{par.zero_stage}{ep})")
        attempt = uuid.uuid4().hex
        build_trainer(run, attempt, reporter).fit()
        if (step := paused_step(run.output_uri, attempt)) is not None:
            log.info("job %s paused at step %d", run.job_id, step)
            reporter.paused()
            return True
        summary = json.loads(storage.read_text(storage.join(run.output_uri, SUMMARY_FILE)))
    except Exception as e:  # noqa: BLE001 - every failure becomes one ResultReport
        cause = root_cause(e)
        log.error("job %s failed: %s", run.job_id, cause.message)
        reporter.failed(cause.code, cause.message, cause.param)
        return False
    reporter.succeeded(
        fine_tuned_model=storage.join(run.output_uri, ADAPTER_DIR),
        result_files=[storage.join(run.output_uri, METRICS_FILE)],
        trained_tokens=summary["trained_tokens"],
    )
    return True


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run = JobRunSpec.model_validate_json(os.environ[ENV_RUN_SPEC])
    return 0 if run_job(run, Reporter(run.job_id)) else 1


if __name__ == "__main__":
    sys.exit(main())
