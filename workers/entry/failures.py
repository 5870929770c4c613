"""A Ray Train callback in the job's controller: reports each lost worker before Ray Train restarts the group."""

from __future__ import annotations

from ray.train import UserCallback

from moetune.workers.reporting.reporter import Reporter


class ReportWorkerFailures(UserCallback):
    """Sends a job event per worker-group failure. A JobError (the user's data or spec) stops the run instead:
    a restart would only fail the same way again."""

    def __init__(self, reporter: Reporter, max_failures: int):
        self.reporter, self.max_failures, self.failures = reporter, max_failures, 0

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        from moetune.workers.entry.driver import job_error, root_cause

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
