"""The memory planner for the control plane, which stays free of the training stack: the planner runs in a child
process (`python -m moetune.workers.planner`) with a time limit. Used by POST /v1/fine_tuning/plans and by
submission, which refuses a job whose parallelism cannot fit the configured cluster (MOETUNE_CLUSTER)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from moetune.api.errors import ErrorCode
from moetune.api.models.run_config import RunConfig
from moetune.api.plans import ClusterSpec, Plan, PlannedLayout, parse_cluster
from moetune.service.errors import APIException, invalid_request
from moetune.service.settings import Settings

log = logging.getLogger("moetune.planning")
TIMEOUT_S = 120.0


class PlannerUnavailable(Exception):
    """The planner child did not answer (the training stack is not installed here, it crashed or ran too long)."""


def run_planner(config: dict, job: RunConfig, choose_checkpointing: bool, cluster: ClusterSpec,
                timeout_s: float = TIMEOUT_S) -> Plan:
    """The plan of `job` (`choose_checkpointing`: the request left activation checkpointing to the plan); an
    APIException (422) for what the planner refuses in the request, PlannerUnavailable when it gives no answer."""
    body = json.dumps({"config": config, "job": job.model_dump(mode="json"), "cluster": cluster.model_dump(),
                       "choose_checkpointing": choose_checkpointing})
    try:
        done = subprocess.run([sys.executable, "-m", "moetune.workers.planner"], input=body, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise PlannerUnavailable(f"the planner took more than {timeout_s:g} s") from None
    try:
        answer = json.loads(done.stdout)
    except ValueError:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise PlannerUnavailable(f"the planner exited with status {done.returncode}: {tail[0]}") from None
    if "error" in answer:
        error = answer["error"]
        raise invalid_request(error["message"], error.get("param"))
    return Plan.model_validate(answer["plan"])


def plan_or_error(config: dict, job: RunConfig, choose_checkpointing: bool, cluster: ClusterSpec) -> Plan:
    """For the plans route: a planner that gives no answer is a 503 saying why."""
    try:
        return run_planner(config, job, choose_checkpointing, cluster)
    except PlannerUnavailable as e:
        raise APIException(503, ErrorCode.internal_error, f"The memory planner is unavailable: {e}.") from None


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _breakdown(fit: PlannedLayout) -> str:
    parts = []
    for name, value in fit.bytes.items():
        amount = sum(value.values()) if isinstance(value, dict) else value
        if amount:
            parts.append(f"{name.replace('_', ' ')} {_gib(amount)}")
    return ", ".join(parts)


def check_fits(config: dict, job: RunConfig, choose_checkpointing: bool, settings: Settings) -> Plan | None:
    """The plan of a GPU job on the configured cluster's GPUs (None for CPU jobs, without MOETUNE_CLUSTER, or when
    the planner gave no answer: the job is left to the workers); a 422 (param `parallelism`) when it cannot fit,
    with the plan's breakdown and a layout that would fit (the fastest estimated of its workers, else the fewest
    GPUs)."""
    if job.parallelism.gpus_per_worker == 0 or not settings.cluster:
        return None
    try:
        plan = run_planner(config, job, choose_checkpointing, parse_cluster(settings.cluster))
    except PlannerUnavailable as e:
        log.warning("memory plan skipped for a submission: %s", e)
        return None
    submitted = plan.submitted
    if submitted.fits:
        return plan
    fit = plan.recommended or plan.fewest_gpus
    which = "the fastest layout that fits (estimated)" if plan.recommended else "the fewest GPUs that fit it"
    fix = (f"{which} is {fit.describe()} ({_gib(fit.total_bytes)} per GPU)" if fit
           else "no layout on this cluster fits it")
    raise invalid_request(
        f"parallelism: the job needs {_gib(submitted.total_bytes)} per GPU, more than the usable "
        f"{_gib(plan.cluster.usable_bytes_per_gpu)} of the cluster's GPUs ({submitted.describe()}: "
        f"{_breakdown(submitted)}); {fix}", "parallelism")
