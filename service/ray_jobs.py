"""The few Ray Jobs API calls the scheduler makes, with Ray's errors mapped to what the scheduler decides on."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ray.job_submission import JobSubmissionClient

log = logging.getLogger(__name__)


class RayUnavailable(Exception):
    """The Jobs API could not be reached; try again on a later tick."""


@dataclass(frozen=True)
class RayJobState:
    status: str  # ray.job_submission.JobStatus value: PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED
    message: str | None


class _TimedClient(JobSubmissionClient):
    """Ray's client sends requests without a timeout; a hung head must not stall the scheduler thread."""

    timeout_s = 15.0

    def _do_request(self, method, endpoint, **kwargs):
        kwargs.setdefault("timeout", self.timeout_s)
        return super()._do_request(method, endpoint, **kwargs)


def _is_not_found(error: RuntimeError) -> bool:
    return "status code 404" in str(error)


class RayJobs:
    def __init__(self, address: str):
        self.address = address
        self._client: JobSubmissionClient | None = None
        self._down = False  # to log outages once, not on every tick

    def _call(self, method: str, *args, **kwargs):
        try:
            if self._client is None:
                self._client = _TimedClient(self.address)  # checks the connection
            result = getattr(self._client, method)(*args, **kwargs)
        except OSError as e:  # builtin ConnectionError and every requests exception
            self._client = None
            if not self._down:
                log.warning("Ray Jobs API at %s is unreachable (%s); retrying every scheduler tick", self.address, e)
            self._down = True
            raise RayUnavailable(str(e)) from e
        if self._down:
            log.info("Ray Jobs API at %s is reachable again", self.address)
            self._down = False
        return result

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
        return RayJobState(status=str(info.status.value), message=info.message)

    def stop(self, submission_id: str) -> None:
        """Asks Ray to stop the job; a submission Ray no longer knows needs no stopping."""
        try:
            self._call("stop_job", submission_id)
        except RuntimeError as e:
            if not _is_not_found(e):
                raise
