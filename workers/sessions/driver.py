"""A session's Ray job (`python -m moetune.workers.sessions.driver`): the worker group, held until the session
closes or idles out; then the control plane hears why it ended.

Reads the SessionRunSpec from MOETUNE_RUN_SPEC, the control plane's address and the session's token from the job's
usual variables (moetune.api.environment).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig

from moetune.api.errors import ErrorCode
from moetune.api.models.responses import ErrorInfo
from moetune.api.models.training_sessions import SessionRunSpec
from moetune.workers.errors import JobError
from moetune.workers.loop.trainer import TrainerWithoutRayData
from moetune.workers.model_config import check_supported, read_remote_config
from moetune.workers.sessions.control import SessionLink
from moetune.workers.sessions.worker import session_loop_per_worker
from moetune.workers.settings import WorkerSettings, worker_env

log = logging.getLogger("moetune.session")


def run_session(session: SessionRunSpec) -> bool:
    par = session.spec.parallelism
    # the layout against the model (routed experts, layers): the control plane checked it against the workers only
    check_supported(read_remote_config(session.spec.model), session.spec.lora, par)
    resources = par.worker_resources()
    trainer = TrainerWithoutRayData(
        session_loop_per_worker,
        train_loop_config={"session": session, "threads": int(resources["CPU"]), "worker_env": worker_env(),
                           "attempt": str(session.attempt)},
        scaling_config=ScalingConfig(num_workers=par.num_workers, use_gpu=par.gpus_per_worker > 0,
                                     resources_per_worker=resources),
        # nothing of a session goes through Ray Train's storage (states go to the session's output_uri)
        run_config=RunConfig(name=f"{session.session_id}-{session.attempt}",
                             storage_path=os.path.join(tempfile.gettempdir(), "moetune-sessions"),
                             failure_config=FailureConfig(max_failures=0)),
    )
    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING)
    trainer.fit()
    return True


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = WorkerSettings()
    session = SessionRunSpec.model_validate_json(settings.run_spec)
    try:
        return 0 if run_session(session) else 1
    except Exception as e:  # noqa: BLE001 - the control plane must hear why the group is gone
        log.exception("session %s: the worker group failed", session.session_id)
        cause = e.__cause__ or e
        error = (ErrorInfo(code=cause.code, message=cause.message, param=cause.param) if isinstance(cause, JobError)
                 else ErrorInfo(code=ErrorCode.session_failed, message=f"{type(cause).__name__}: {cause}"))
        SessionLink(settings.callback_url, settings.job_token, session).ended("failed", error)
        return 1


if __name__ == "__main__":
    sys.exit(main())
