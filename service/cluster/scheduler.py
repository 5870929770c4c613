"""The background loop that moves jobs along: file checks, Ray submission, following and stopping Ray jobs.

All state lives in the store, so a restarted control plane picks up where the previous one stopped.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable

from moetune.api.errors import ErrorCode
from moetune.api.layout import result_from_summary, summary_uri
from moetune.api.environment import (
    ENV_CALLBACK_URL,
    ENV_IMAGE_LIMITS,
    ENV_JOB_TOKEN,
    ENV_RUN_SPEC,
    ENV_S3_ENDPOINT_URL,
    ENV_URI_ACCESS,
)
from moetune.api.models.job_run import JobRunSpec, ResultReport
from moetune.api.models.parallelism import ParallelDims
from moetune.api.models.responses import ErrorInfo, JobStatus
from moetune.api.models.run_config import RunConfig
from moetune.service.auth import hash_token, new_job_token
from moetune.service.cluster.deployments import DeploymentRestorer
from moetune.service.cluster.leader import LeaderLease
from moetune.service.cluster.ray_jobs import RayJobs, RayUnavailable
from moetune.service.cluster.resources import NodeResources, Shortage, never_placeable, wait_reason
from moetune.service import quotas
from moetune.service.lifecycle import SLOT_STATUSES, finish_job
from moetune.service.settings import Settings
from moetune.service.store import JobRow, Store
from moetune.service.submission.job_storage import missing_input, read_json
from moetune.service.submission.uri_policy import tenant_access

log = logging.getLogger(__name__)

_MAX_CAUSE_CHARS = 300
_STORAGE_BACKOFF_S = (1.0, 60.0)  # first and longest wait between file checks while storage does not answer
# what a driver's Ray calls raise when the head (GCS, raylet) vanishes beneath them (workers.entry.failures names
# the innermost error's type first)
_HEAD_LOSS_ERRORS = ("ActorUnavailableError", "ActorDiedError", "RaySystemError", "RpcError", "NodeDiedError")
_MAX_ATTEMPTS = 10  # a job whose Ray submission keeps vanishing fails (ray_job_lost) at this attempt
_QUEUE_SCAN = 200  # queued jobs looked at per pass: those over their tenant's quota are passed over


def submission_id(job_id: str, attempt: int) -> str:
    """Deterministic per attempt: a control plane restarted mid-submission finds its own submission again."""
    return f"moetune-{job_id}-{attempt}"


def short_cause(ray_message: str | None) -> str:
    """Ray's failure message without the driver's log dump: its first line plus the last log line."""
    if not ray_message:
        return "the Ray job ended without a message"
    first, *rest = ray_message.strip().splitlines()
    cause = re.split(r",? last available logs", first)[0].rstrip(".:, ")
    last_log_line = next((line.strip() for line in reversed(rest) if line.strip()), None)
    if last_log_line:
        cause += f" ({last_log_line})"
    return cause[:_MAX_CAUSE_CHARS]


def _run_config(job: JobRow) -> RunConfig:
    return RunConfig.model_validate(job.run_config)


def _parallelism(job: JobRow) -> ParallelDims:
    return _run_config(job).parallelism


def _held(jobs: list[JobRow]) -> dict[str, float]:
    """The Ray resources the jobs' workers take."""
    held: dict[str, float] = {}
    for job in jobs:
        par = _parallelism(job)
        for name, amount in par.worker_resources().items():
            held[name] = held.get(name, 0.0) + amount * par.num_workers
    return held


class Scheduler:
    def __init__(self, store: Store, settings: Settings, ray: RayJobs | None = None,
                 on_dependency_error: Callable[[str], None] = lambda dependency: None,
                 lease: LeaderLease | None = None):
        self.store = store
        self.settings = settings
        self.on_dependency_error = on_dependency_error  # the control plane's metric, per dependency
        self.ray = ray or RayJobs(settings.ray_address, on_error=lambda: on_dependency_error("ray"))
        self.lease = lease or LeaderLease(store, settings.scheduler_lease_s, settings.scheduler_lease_renew_s)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # The lease epoch of the current pass (None when a test drives tick() itself: no fencing).
        self._epoch: int | None = None
        self._storage_backoff_s = 0.0
        self._storage_retry_at = 0.0
        self._capacity: list | None = None  # the Ray nodes' totals last seen, and since when (monotonic)
        self._capacity_since = 0.0
        self.deployments = DeploymentRestorer(store, settings)  # brings back what Serve lost
        # what else the leader does at each pass, from the rooms above (app.py: the sessions' start timeout)
        self.leader_passes: list[Callable[[], object]] = []

    # ------------------------------------------------------------ thread

    def start(self) -> None:
        self._stopping.clear()
        self.lease.start()
        self._thread = threading.Thread(target=self._run, name="moetune-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
            self.lease.stop()

    def _run(self) -> None:
        """Passes while this replica holds the scheduler lease; the other replicas only serve the API."""
        while not self._stopping.is_set():
            if (epoch := self.lease.epoch()) is not None:
                self.tick(epoch)
            self._stopping.wait(self.settings.scheduler_interval_s)

    def tick(self, epoch: int | None = None) -> None:
        """One pass under lease `epoch`; a failing step is logged and retried next tick, never ends the thread."""
        self._epoch = epoch
        restore = (self.deployments.restore,) if self.settings.restore_deployments else ()
        for step in (self.stop_cancelled, self.follow_running, self.validate_files, self.submit_queued, *restore,
                     *self.leader_passes):
            try:
                step()
            except RayUnavailable:
                pass  # logged by RayJobs when it goes down; jobs wait for the next tick
            except Exception:
                log.exception("scheduler step %s failed; retrying next tick", step.__name__)

    # ------------------------------------------------------------ steps

    def stop_cancelled(self) -> None:
        for job in self.store.jobs_to_stop():
            self.ray.stop(job.ray_submission_id)
            self.store.update_job(job.id, cancel_requested=False)
            log.info("stopped Ray job %s of %s job %s", job.ray_submission_id, job.status, job.id)

    def follow_running(self) -> None:
        """Ends jobs whose Ray job ended without the driver's ResultReport reaching us (e.g. while we were down)."""
        jobs = self.store.jobs_with_status(*SLOT_STATUSES)
        for job, state in zip(jobs, self.ray.states([job.ray_submission_id for job in jobs])):
            if state is None:
                self._requeue_lost(job, f"Ray no longer knows job {job.ray_submission_id} (its Ray head "
                                        "restarted)", fence=self._epoch)
            elif state.supervisor_lost:
                self._requeue_lost(job, f"Ray lost the supervisor of job {job.ray_submission_id} with its head "
                                        f"({short_cause(state.message)})", fence=self._epoch)
            elif state.status in ("FAILED", "STOPPED"):
                self._fail(job, ErrorCode.driver_failed, short_cause(state.message))
            elif state.status == "SUCCEEDED":
                self._recover_result(job)

    def requeue_if_head_lost(self, job: JobRow, result: ResultReport) -> bool:
        """For a driver's result: a failure on a Ray system error (an actor or node gone) while Ray's Jobs API
        does not answer, or answers without the job's submission, is the head dying beneath the job, no training
        failure: the job is requeued to continue from its newest complete checkpoint. False otherwise (the
        result is the run's own)."""
        error = result.error
        if result.status != "failed" or error is None or error.code != ErrorCode.training_failed \
                or error.message.split(":", 1)[0] not in _HEAD_LOSS_ERRORS:
            return False
        if not self.ray.reachable():  # one call now, whatever the backoff
            cause = f"the Ray head at {self.ray.address} stopped answering under job {job.ray_submission_id}"
        elif self.ray.state(job.ray_submission_id) is None:
            cause = f"Ray no longer knows job {job.ray_submission_id} (its Ray head restarted)"
        else:
            return False
        return self._requeue_lost(job, cause)

    def _requeue_lost(self, job: JobRow, cause: str, fence: int | None = None) -> bool:
        """A job whose Ray submission vanished goes back into the queue (a pausing one ends paused) as its next
        attempt, which resumes from the newest complete checkpoint; after _MAX_ATTEMPTS it fails as
        ray_job_lost (a job that takes its head down every time). `fence`: the scheduler pass's lease epoch (its
        view of Ray may be stale once deposed: the new leader may already run the next attempt); a driver's
        report, which any replica receives, is fresh and needs none."""
        if job.attempt >= _MAX_ATTEMPTS:
            self._fail(job, ErrorCode.ray_job_lost, f"{cause}; attempt {job.attempt} of {_MAX_ATTEMPTS}, no more")
            return True
        if job.status == JobStatus.pausing:
            to, message = JobStatus.paused, f"Job paused: {cause}; resuming continues from its last checkpoint"
        else:
            to, message = JobStatus.queued, f"Job requeued: {cause}; the next attempt continues from its last " \
                                            "checkpoint"
        moved = self.store.transition(job.id, [JobStatus(job.status)], to, message, level="warn",
                                      fence=fence, attempt=JobRow.attempt + 1, estimated_finish=None)
        if moved:
            log.warning("job %s: %s", job.id, message)
        return moved

    def _recover_result(self, job: JobRow) -> None:
        """The driver exited 0 but its result report never arrived: the outputs in storage tell what happened."""
        summary = read_json(summary_uri(job.output_uri), self.settings.s3_endpoint_url)
        if summary is not None:
            finish_job(self.store, job, result_from_summary(job.output_uri, summary))
        elif job.status == JobStatus.pausing:  # a paused driver exits 0 without a summary
            finish_job(self.store, job, ResultReport(status="paused"))
        else:
            self._fail(job, ErrorCode.driver_failed, "driver exited without reporting a result")

    def validate_files(self) -> None:
        if time.monotonic() < self._storage_retry_at:
            return
        for job in self.store.jobs_with_status(JobStatus.validating_files):
            try:
                error = missing_input(_run_config(job), self.settings.s3_endpoint_url)
            except Exception as e:  # noqa: BLE001 - storage down or timing out: worth a retry, not a failed job
                self._storage_unreachable(e)
                return
            if error is None:
                self.store.transition(job.id, [JobStatus.validating_files], JobStatus.queued, "Job queued",
                                      queue_reason=None)
            else:
                self.store.transition(job.id, [JobStatus.validating_files], JobStatus.failed,
                                      f"Job failed: {error.message}", level="error", error=error.model_dump())
        self._storage_backoff_s = 0.0

    def _storage_unreachable(self, error: Exception) -> None:
        """Every job waiting for its file check says why; the next check waits 1 s, 2 s, 4 s ... up to a minute."""
        first, longest = _STORAGE_BACKOFF_S
        if not self._storage_backoff_s:
            log.warning("object storage does not answer (%s); checking job files again with backoff", error)
        self._storage_backoff_s = min(max(self._storage_backoff_s * 2, first), longest)
        self._storage_retry_at = time.monotonic() + self._storage_backoff_s
        self.on_dependency_error("storage")
        reason = (f"Object storage is not reachable ({type(error).__name__}: {str(error)[:200]}); checking the "
                  f"files again with backoff")
        for job in self.store.jobs_with_status(JobStatus.validating_files):
            self.store.note_queue_reason(job.id, reason, [JobStatus.validating_files])

    def submit_queued(self) -> None:
        """Starts queued jobs, highest priority first and the tenants taking turns within one, while jobs holding a
        slot and open training sessions < max_running_jobs and the Ray cluster has the resources their workers
        need; a job that must wait says why (queue_reason). One over its tenant's quota is passed over: the next
        tenant's job goes first. Under the slots lock: a session created meanwhile cannot take the same place."""
        with self.store.slots_locked():
            self._submit_queued()

    def _submit_queued(self) -> None:
        holding = self.store.jobs_with_status(*SLOT_STATUSES)
        sessions = quotas.open_sessions(self.store)
        free = self.settings.max_running_jobs - len(holding) - sessions
        if free <= 0:
            reason = quotas.slots_full(len(holding), sessions, self.settings.max_running_jobs)
            for job in self.store.next_queued(20):
                self.store.note_queue_reason(job.id, f"waiting for {reason}", [JobStatus.queued], level="info")
            return
        queued = self.store.next_queued(_QUEUE_SCAN)
        if not queued:
            return
        try:
            nodes = self.ray.cluster_nodes()
        except RayUnavailable as e:
            for job in queued[:free]:
                self.store.note_queue_reason(job.id, f"Ray is not reachable ({e}); retrying with backoff",
                                             [JobStatus.queued])
            raise
        settled = self._nodes_settled(nodes)
        held = _held(holding)
        usage = quotas.usage_by_tenant(self.store, holding, time.time())
        for job in queued:
            if free == 0:
                return
            if reason := quotas.wait_reason(self.settings.tenant_quotas, usage, job):
                self.store.note_queue_reason(job.id, reason, [JobStatus.queued], level="info")
                continue
            par = _parallelism(job)
            if nodes:  # no report yet (a head just started): Ray's own placement decides
                shortage = never_placeable(par, nodes)
                if shortage is not None and self.settings.fail_unschedulable:
                    if settled:
                        self._fail_unschedulable(job, shortage)
                        continue
                    reason = (f"{shortage.message}; the Ray cluster's nodes changed less than "
                              f"{self.settings.unschedulable_grace_s:g} s ago, so the job waits for them to settle "
                              "before it fails")
                else:
                    reason = shortage.message if shortage else wait_reason(par, nodes, held)
                if reason:
                    # strict priority order: a smaller job behind it does not overtake it
                    self.store.note_queue_reason(job.id, reason, [JobStatus.queued])
                    return
            if self._submit(job):
                free -= 1
                quotas.add_run(usage, job, time.time())
                for name, amount in _held([job]).items():
                    held[name] = held.get(name, 0.0) + amount

    # ------------------------------------------------------------ helpers

    def _nodes_settled(self, nodes: list[NodeResources]) -> bool:
        """Whether the Ray nodes' totals have looked the same for unschedulable_grace_s (an empty report counts as
        no view). Ray's resource report lags a node that just joined, and the nodes rejoining a head that just came
        back: a job no node can hold fails only once the view held still that long (the first view, from a
        control plane that just started, counts as a change)."""
        now = time.monotonic()
        if nodes and (capacity := sorted(sorted(node.total.items()) for node in nodes)) != self._capacity:
            self._capacity, self._capacity_since = capacity, now
        return self._capacity is not None and now - self._capacity_since >= self.settings.unschedulable_grace_s

    def _submit(self, job: JobRow) -> bool:
        """Submits the job's attempt to Ray and marks it running; False when another actor (a user's cancel or
        pause, a newer scheduler leader) got there first."""
        sid = submission_id(job.id, job.attempt)
        # Ray may already run this attempt: submitted just before a control plane restart, or by the previous
        # leader. Its token (hash stored before submission) stays valid; a new token would lock its driver out.
        if self.ray.state(sid) is None:
            token = new_job_token()
            # The hash is stored before Ray gets the token, so the driver's first report is already accepted.
            if not self.store.update_job(job.id, only_if_status=[JobStatus.queued], fence=self._epoch,
                                         job_token_hash=hash_token(token)):
                return False  # cancelled or paused meanwhile, or this replica no longer leads
            if self._epoch is not None and not self.lease.still_held(self._epoch):
                return False  # the lease ran out while the token was written: the next leader submits
            self.ray.submit(sid, self.settings.driver_entrypoint, self.job_env(job, token))
        if not self.store.transition(job.id, [JobStatus.queued], JobStatus.running, "Job started",
                                     fence=self._epoch, ray_submission_id=sid, queue_reason=None):
            # Cancelled or paused while submitting: record the submission so stop_cancelled ends it. (A deposed
            # leader's submission needs nothing: the new leader finds it in Ray under the same id.)
            self.store.update_job(job.id, only_if_status=[JobStatus.cancelled, JobStatus.paused],
                                  ray_submission_id=sid, cancel_requested=True)
            return False
        log.info("submitted %s as Ray job %s", job.id, sid)
        return True

    def job_env(self, job: JobRow, token: str) -> dict[str, str]:
        run_spec = JobRunSpec(job_id=job.id, config=_run_config(job), output_uri=job.output_uri)
        env = {name: os.environ[name] for name in self.settings.worker_env_passthrough if name in os.environ}
        env.update({
            ENV_RUN_SPEC: run_spec.model_dump_json(),
            ENV_CALLBACK_URL: self.settings.callback_url,
            ENV_JOB_TOKEN: token,
            # the driver checks the image URIs inside the data files against the same access as the job's fields
            ENV_URI_ACCESS: tenant_access(job.tenant, self.settings).model_dump_json(),
            ENV_IMAGE_LIMITS: self.settings.image_limits.model_dump_json(),
        })
        if self.settings.s3_endpoint_url:
            env[ENV_S3_ENDPOINT_URL] = self.settings.s3_endpoint_url
        return env

    def _fail_unschedulable(self, job: JobRow, shortage: Shortage) -> None:
        message = f"{shortage.param}: {shortage.message}; this job can never start on this cluster"
        error = ErrorInfo(code=ErrorCode.unschedulable, message=message, param=shortage.param)
        if self.store.transition(job.id, [JobStatus.queued], JobStatus.failed, f"Job failed: {message}",
                                 level="error", error=error.model_dump(), queue_reason=None):
            log.info("job %s failed: %s", job.id, message)

    def _fail(self, job: JobRow, code: ErrorCode, message: str) -> None:
        error = ErrorInfo(code=code, message=message)
        if self.store.transition(job.id, SLOT_STATUSES, JobStatus.failed, f"Job failed: {message}",
                                 level="error", error=error.model_dump(), estimated_finish=None):
            log.info("job %s failed: %s", job.id, message)
