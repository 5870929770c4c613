"""What a failed job reports: the user's error (a JobError) behind a Ray Train failure, else its innermost cause in
one line; and the Ray Train callback in the job's controller that reports each lost worker before Ray Train
restarts the group."""

from __future__ import annotations

from ray.train import UserCallback
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

from moetune.api.environment import ENV_PLACEMENT_TIMEOUT_S
from moetune.api.errors import ErrorCode
from moetune.workers.errors import JobError
from moetune.workers.reporting.reporter import Reporter
from moetune.workers.settings import WorkerSettings


# Ray Train's wait for a worker group's placement, read by its controller from the driver's environment
RAY_TRAIN_START_TIMEOUT = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


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
        context = None if e.__suppress_context__ else e.__context__  # `raise ... from None` hides it
        pending += [c for c in (getattr(e, "controller_failure", None), e.__cause__, context) if c]
    return chain


def job_error(error: BaseException) -> JobError | None:
    """The first JobError (a problem the user must fix) behind `error`, if any."""
    return next((e for e in _chain(error) if isinstance(e, JobError)), None)


def root_cause(error: BaseException) -> JobError:
    """The first JobError behind a Ray Train failure, or the innermost error in one line."""
    if found := job_error(error):
        return found
    if timeout := next((e for e in _chain(error) if isinstance(e, WorkerGroupStartupTimeoutError)), None):
        return JobError(ErrorCode.unschedulable, f"parallelism: Ray did not place the job's {timeout.num_workers} "
                        f"workers within {WorkerSettings().placement_timeout_s:g} s (setting "
                        f"{ENV_PLACEMENT_TIMEOUT_S}): the cluster has no room for them now (other work holds the "
                        "resources, or a node left); submit it again later or ask for fewer resources", "parallelism")
    innermost = _chain(error)[-1]
    text = str(innermost).strip().splitlines()
    message = f"{type(innermost).__name__}: {text[-1] if text else ''}".strip()
    return JobError(ErrorCode.training_failed, message[:500])


class ReportWorkerFailures(UserCallback):
    """Sends a job event per worker-group failure. A JobError (the user's data or spec) stops the run instead:
    a restart would only fail the same way again."""

    def __init__(self, reporter: Reporter, max_failures: int):
        self.reporter, self.max_failures, self.failures = reporter, max_failures, 0

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        for error in worker_exceptions.values():
            if user_error := job_error(error):
                raise user_error  # Ray Train does not retry an error raised here; the driver reports it
        self.failures += 1
        ranks = sorted(worker_exceptions)
        retry = ("restarting the worker group from the newest complete checkpoint"
                 if self.failures <= self.max_failures else "no restarts left")
        cause = root_cause(worker_exceptions[ranks[0]]).message
        self.reporter.event(f"Worker failure {self.failures} (rank {', '.join(map(str, ranks))}): {cause}; {retry}",
                            level="warn", data={"failure": self.failures, "max_failures": self.max_failures,
                                                "ranks": ranks})
