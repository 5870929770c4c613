"""The Ray job's driver (`python -m moetune.workers.entry.driver`): checks the job, runs the Ray Train worker group,
and sends the control plane the final result.

Reads the JobRunSpec from MOETUNE_RUN_SPEC; reports go to MOETUNE_CALLBACK_URL with
MOETUNE_JOB_TOKEN (see moetune.api.environment). Exit code 0 when the job succeeded or paused, 1 when it failed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig

from moetune.api import storage
from moetune.api.layout import report_html_uri, report_json_uri, result_from_summary, summary_uri
from moetune.api.models.job_run import JobRunSpec
from moetune.api.models.lora import LoraSpec
from moetune.api.models.responses import EventLevel
from moetune.workers.checkpoints.run_state import complete_checkpoints, paused_step
from moetune.workers.entry.checks import validate
from moetune.workers.entry.failures import RAY_TRAIN_START_TIMEOUT, ReportWorkerFailures, root_cause
from moetune.workers.loop.trainer import TrainerWithoutRayData
from moetune.workers.loop.worker import train_loop_per_worker
from moetune.workers.lora.coverage import Coverage
from moetune.workers.reporting.adaptation_report import write_report
from moetune.workers.reporting.reporter import Reporter
from moetune.workers.settings import WorkerSettings, worker_env

log = logging.getLogger("moetune.driver")


def _storage_for_ray(uri: str, s3_endpoint_url: str | None):
    """(storage_path, pyarrow filesystem or None) for Ray Train's run state under `uri`."""
    if uri.startswith("file://"):
        return uri[len("file://"):], None
    if uri.startswith("s3://") and s3_endpoint_url:
        from pyarrow.fs import S3FileSystem

        scheme, _, host = s3_endpoint_url.partition("://")
        return uri[len("s3://"):], S3FileSystem(endpoint_override=host, scheme=scheme)
    return uri, None


def build_trainer(run: JobRunSpec, attempt: str, reporter: Reporter, settings: WorkerSettings):
    par = run.config.parallelism
    use_gpu = par.gpus_per_worker > 0
    resources = par.worker_resources()
    storage_path, storage_fs = _storage_for_ray(storage.join(run.output_uri, "ray"), settings.s3_endpoint_url)
    # Ray Train waits this long for the group's placement (its controller reads the variable from the driver's
    # environment), then fails the run: controller_failure_limit=0, where Ray Train's default (-1) would retry,
    # and so wait, forever
    os.environ[RAY_TRAIN_START_TIMEOUT] = str(settings.placement_timeout_s)
    return TrainerWithoutRayData(
        train_loop_per_worker,
        train_loop_config={
            "run": run,  # as parsed from MOETUNE_RUN_SPEC, the spec's one serialisation (Ray ships the object)
            "threads": int(resources["CPU"]),  # torch threads = the worker's CPU share
            "worker_env": worker_env(),
            "attempt": attempt,
        },
        scaling_config=ScalingConfig(num_workers=par.num_workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=run.job_id,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            # A restarted group resumes from the newest complete checkpoint (workers.checkpoints.run_state).
            failure_config=FailureConfig(max_failures=settings.max_worker_failures, controller_failure_limit=0),
            callbacks=[ReportWorkerFailures(reporter, settings.max_worker_failures)],
        ),
    )


def report_coverage(reporter: Reporter, lora: Coverage, spec: LoraSpec) -> None:
    """What LoRA adapts, then a warning event for each layer type it leaves unadapted (the job goes on)."""
    reporter.event(lora.summary(), data={"lora_coverage": lora.rows(), "trainable_parameters": lora.trainable})
    for kind, message in lora.warnings(spec):
        reporter.event(message, level=EventLevel.warn, data={"layer_type": kind})


def run_job(run: JobRunSpec, reporter: Reporter, settings: WorkerSettings) -> bool:
    """Runs the whole job and sends its ResultReport; True on success or pause."""
    try:
        rows, lora = validate(run, settings)
        reporter.event(f"Files validated: {rows} training rows")
        report_coverage(reporter, lora, run.config.lora)
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING)
        par = run.config.parallelism
        ep = f", expert parallel {par.expert_parallel_size}" if par.expert_parallel_size > 1 else ""
        reporter.event(f"Starting {par.num_workers} workers (ZeRO-{par.zero_stage}{ep})")
        attempt = uuid.uuid4().hex
        build_trainer(run, attempt, reporter, settings).fit()
        if (step := paused_step(run.output_uri, attempt)) is not None:
            log.info("job %s paused at step %d", run.job_id, step)
            reporter.paused()
            return True
        summary = json.loads(storage.read_text(summary_uri(run.output_uri)))
    except Exception as e:  # noqa: BLE001 - every failure becomes one ResultReport
        cause = root_cause(e)
        log.error("job %s failed: %s", run.job_id, cause.message)
        reporter.failed(cause.code, cause.message, cause.param)
        return False
    _write_report(run, lora.rows(), summary, reporter)
    reporter.send(result_from_summary(run.output_uri, summary))
    return True


def _write_report(run: JobRunSpec, lora_coverage: list[dict], summary: dict, reporter: Reporter) -> None:
    """The adaptation report next to the adapter; a report that cannot be written costs the job nothing."""
    try:
        write_report(run, lora_coverage, summary, {step for step, _ in complete_checkpoints(run.output_uri)})
    except Exception as e:  # noqa: BLE001 - the trained adapter is there whatever happens to its report
        log.warning("job %s: adaptation report not written", run.job_id, exc_info=True)
        reporter.event(f"Adaptation report not written: {type(e).__name__}: {e}", level="warn")
        return
    reporter.event(f"Adaptation report written: {report_html_uri(run.output_uri)}",
                   data={"report": report_json_uri(run.output_uri)})


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = WorkerSettings()
    run = JobRunSpec.model_validate_json(settings.run_spec)
    return 0 if run_job(run, Reporter(run.job_id, settings.callback_url, settings.job_token), settings) else 1


if __name__ == "__main__":
    sys.exit(main())
