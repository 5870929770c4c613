"""The few Ray Jobs API calls the scheduler makes, with Ray's errors mapped to what the scheduler decides on."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from ray.dashboard.modules.job.common import JOB_ACTOR_NAME_TEMPLATE, JobErrorType
from ray.dashboard.modules.job.job_supervisor import JobSupervisor
from ray.job_submission import JobSubmissionClient

from moetune.service.cluster.resources import NodeResources, nodes_from_cluster_status

log = logging.getLogger(__name__)

# After a failed call the next ones wait 1 s, 2 s, 4 s ... up to a minute (not one attempt per scheduler tick).
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 1.0, 60.0
_STATE_API_LIMIT = 10_000  # the most actors Ray's state API lists in one answer (RAY_MAX_LIMIT_FROM_API_SERVER)


class RayUnavailable(Exception):
    """The Jobs API could not be reached; try again on a later tick."""


# How Ray's job manager fails a job whose supervisor actor is gone: with GCS fault tolerance a restarted head still
# knows the submission, but the supervisor (and the driver under it) died with the old head.
_SUPERVISOR_LOST = {e.value for e in (JobErrorType.JOB_SUPERVISOR_ACTOR_DIED,
                                      JobErrorType.JOB_SUPERVISOR_ACTOR_START_FAILURE,
                                      JobErrorType.JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE)}


@dataclass(frozen=True)
class RayJobState:
    status: str  # ray.job_submission.JobStatus value: PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED
    message: str | None
    supervisor_lost: bool = False  # Ray lost the job's supervisor (FAILED for it, or RUNNING without it)


class _TimedClient(JobSubmissionClient):
    """Ray's client sends requests without a timeout; a hung head must not stall the scheduler thread."""

    timeout_s = 15.0

    def _do_request(self, method, endpoint, **kwargs):
        kwargs.setdefault("timeout", self.timeout_s)
        return super()._do_request(method, endpoint, **kwargs)


def _is_not_found(error: RuntimeError) -> bool:
    return "status code 404" in str(error)


class RayJobs:
    def __init__(self, address: str, on_error=None):
        self.address = address
        self._client: JobSubmissionClient | None = None
        self._down = False  # to log outages once, not on every tick
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._on_error = on_error  # called once per failed call (the control plane's dependency-error metric)

    def _call(self, method: str, *args, **kwargs):
        if self._down and time.monotonic() < self._retry_at:
            raise RayUnavailable(f"the Ray Jobs API at {self.address} is not reachable")
        try:
            if self._client is None:
                self._client = _TimedClient(self.address)  # checks the connection
            result = getattr(self._client, method)(*args, **kwargs)
        except OSError as e:  # builtin ConnectionError and every requests exception
            self._client = None
            if not self._down:
                log.warning("Ray Jobs API at %s is unreachable (%s); retrying with backoff", self.address, e)
            self._down = True
            self._backoff_s = min(max(self._backoff_s * 2, _FIRST_BACKOFF_S), _MAX_BACKOFF_S)
            self._retry_at = time.monotonic() + self._backoff_s
            if self._on_error is not None:
                self._on_error()
            raise RayUnavailable(f"the Ray Jobs API at {self.address} is not reachable") from e
        if self._down:
            log.info("Ray Jobs API at %s is reachable again", self.address)
            self._down, self._backoff_s = False, 0.0
        return result

    def reachable(self) -> bool:
        """For /readyz: one call now, whatever the backoff."""
        self._retry_at = 0.0
        try:
            self._call("get_version")
            return True
        except RayUnavailable:
            return False

    def cluster_nodes(self) -> list[NodeResources]:
        """Each node's total and used resources; empty when Ray has not reported them (yet)."""
        response = self._call("_do_request", "GET", "/api/cluster_status")
        if response.status_code != 200:
            return []
        return nodes_from_cluster_status(response.json().get("data") or {})

    def submit(self, submission_id: str, entrypoint: str, env_vars: dict[str, str]) -> None:
        """Idempotent: a submission id Ray already knows (e.g. from before a restart) counts as submitted."""
        try:
            self._call("submit_job", entrypoint=entrypoint, submission_id=submission_id,
                       runtime_env={"env_vars": env_vars})
        except RuntimeError as e:
            if "No available agent" in str(e):  # the head is up but its job agent is not (yet) serving
                log.warning("Ray at %s has no job agent to take %s yet; retrying next tick", self.address,
                            submission_id)
                raise RayUnavailable(str(e)) from e
            if "already exists" not in str(e):
                raise
            log.warning("Ray already has submission %s; treating it as submitted", submission_id)

    def state(self, submission_id: str) -> RayJobState | None:
        """None when Ray does not know the submission."""
        try:
            info = self._call("get_job_info", submission_id)
        except RuntimeError as e:
            if _is_not_found(e):
                return None
            raise
        return RayJobState(status=str(info.status.value), message=info.message,
                           supervisor_lost=info.error_type in _SUPERVISOR_LOST)

    def states(self, submission_ids: list[str]) -> list[RayJobState | None]:
        """Each submission's `state`, where a RUNNING one whose supervisor actor is gone counts as supervisor_lost,
        with one state-API call for all of them. A head restarted with GCS fault tolerance keeps saying RUNNING
        for a job whose supervisor died with the old head: its job manager (created on a node agent's first job
        request) only looks again once something is submitted."""
        states = [self.state(sid) for sid in submission_ids]
        running = [i for i, state in enumerate(states) if state is not None and state.status == "RUNNING"]
        if not running or (live := self._live_supervisors()) is None:
            return states
        for i in running:
            sid = submission_ids[i]
            if JOB_ACTOR_NAME_TEMPLATE.format(job_id=sid) not in live:
                # RUNNING (set by its supervisor) before the list, which lacks it: the supervisor is gone, unless
                # it ended the job in between, which a second look tells
                again = self.state(sid)
                states[i] = replace(again, supervisor_lost=True) if again and again.status == "RUNNING" else again
        return states

    def _live_supervisors(self) -> set[str] | None:
        """The names of the job supervisor actors the state API reports not DEAD; None when it cannot say (no
        state API: an older or stand-in head; a partial or truncated answer)."""
        response = self._call("_do_request", "GET", "/api/v0/actors", params={
            "filter_keys": ["class_name", "state"], "filter_predicates": ["=", "!="],
            "filter_values": [JobSupervisor.__name__, "DEAD"], "limit": _STATE_API_LIMIT, "detail": "false"})
        if response.status_code != 200:
            return None
        listed = (response.json().get("data") or {}).get("result") or {}
        actors = listed.get("result") or []
        if listed.get("partial_failure_warning") or listed.get("num_filtered", len(actors)) > len(actors):
            return None
        return {actor.get("name") for actor in actors}

    def stop(self, submission_id: str) -> None:
        """Asks Ray to stop the job; a submission Ray no longer knows needs no stopping."""
        try:
            self._call("stop_job", submission_id)
        except RuntimeError as e:
            if not _is_not_found(e):
                raise
