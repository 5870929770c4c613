"""Tenant quotas (settings.tenant_quotas): jobs running at once, workers in use, and a GPU-hour budget.

A job that can never fit its tenant's quota is refused at submission (422); a tenant whose budget is spent gets
429 for new GPU jobs; a job that only has to wait for its tenant's own jobs to end stays queued with its reason.

An open training session (from its creation until its group is gone) counts as a running job: it holds its workers
and their GPUs, and its GPU time counts against the budget. Sessions do not queue: one that does not fit now is a
429 naming the limit.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from sqlalchemy import func, select

from moetune.api.errors import ErrorCode
from moetune.api.models.parallelism import ParallelDims
from moetune.service.api_exception import APIException
from moetune.service.store import SLOT_STATUSES, JobRow, SessionRow, Store

ANY_TENANT = "*"  # the quota of every tenant not named
SESSION_HOLDING = ("starting", "ready", "closing")  # a session's statuses while its group holds workers


class TenantQuota(BaseModel):
    """Unset: no limit. The Helm chart's camelCase keys (maxRunningJobs, ...) are accepted too."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    max_running_jobs: int | None = Field(None, ge=0)  # open training sessions count as running jobs
    max_workers: int | None = Field(None, ge=1)  # workers of its running jobs and open sessions together
    gpu_hours: float | None = Field(None, ge=0)  # GPU-hours its jobs' runs and its sessions may use in all


@dataclass
class TenantUsage:
    running_jobs: int = 0  # open training sessions included
    workers: int = 0
    gpu_seconds: float = 0.0
    sessions: int = 0  # of running_jobs, the open training sessions

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600


def quota_of(quotas: dict[str, TenantQuota], tenant: str) -> TenantQuota:
    return quotas.get(tenant) or quotas.get(ANY_TENANT) or TenantQuota()


def _workers(job: JobRow) -> int:
    return job.spec["parallelism"]["num_workers"]


def add_run(usage: dict[str, TenantUsage], job: JobRow, now: float) -> None:
    """Counts a job holding a slot: its workers, and its run's GPU time so far."""
    used = usage[job.tenant]
    used.running_jobs += 1
    used.workers += _workers(job)
    used.gpu_seconds += max(0.0, now - (job.started_at or now)) * job.gpus


def usage_by_tenant(store: Store, holding: list[JobRow], now: float) -> defaultdict[str, TenantUsage]:
    """Each tenant's use now; `holding` are the jobs holding a slot."""
    usage: defaultdict[str, TenantUsage] = defaultdict(TenantUsage)
    for tenant, seconds in store.ended_gpu_seconds().items():
        usage[tenant].gpu_seconds += seconds
    for job in holding:
        add_run(usage, job, now)
    _add_sessions(store, usage, now)
    return usage


def _add_sessions(store: Store, usage: dict[str, TenantUsage], now: float) -> None:
    """Open sessions as running jobs (GPU time from their creation on); ended ones' GPU-seconds."""
    held = select(SessionRow.tenant, func.count(), func.sum(SessionRow.workers),
                  func.sum((now - SessionRow.created_at) * SessionRow.gpus)) \
        .where(SessionRow.status.in_(SESSION_HOLDING)).group_by(SessionRow.tenant)
    ended = select(SessionRow.tenant, func.sum(SessionRow.gpu_seconds)) \
        .where(SessionRow.status.not_in(SESSION_HOLDING), SessionRow.gpu_seconds > 0).group_by(SessionRow.tenant)
    with store._sessions() as s:
        for tenant, count, workers, gpu_seconds in s.execute(held):
            used = usage[tenant]
            used.running_jobs += count
            used.sessions += count
            used.workers += workers or 0
            used.gpu_seconds += max(0.0, gpu_seconds or 0.0)
        for tenant, gpu_seconds in s.execute(ended):
            usage[tenant].gpu_seconds += gpu_seconds


def _budget_spent(quota: TenantQuota, used: TenantUsage, tenant: str) -> str | None:
    if quota.gpu_hours is not None and used.gpu_hours >= quota.gpu_hours:
        return f"tenant {tenant} has used {used.gpu_hours:.2f} of its {quota.gpu_hours:g} GPU-hour budget"
    return None


def wait_reason(quotas: dict[str, TenantQuota], usage: dict[str, TenantUsage], job: JobRow) -> str | None:
    """Why the job's tenant quota holds it back now, or None."""
    quota, used = quota_of(quotas, job.tenant), usage.get(job.tenant, TenantUsage())
    if job.gpus and (spent := _budget_spent(quota, used, job.tenant)):
        return f"{spent} (tenant_quotas.gpu_hours); the job waits for a larger budget"
    if reason := _over_limit(quota, used, job.tenant, _workers(job)):
        return f"waiting for {reason}"
    return None


def _over_limit(quota: TenantQuota, used: TenantUsage, tenant: str, workers: int) -> str | None:
    """What must end before `workers` more fit the tenant's running-jobs and workers quota, or None."""
    sessions = f" ({used.sessions} of them training sessions)" if used.sessions else ""
    if quota.max_running_jobs is not None and used.running_jobs >= quota.max_running_jobs:
        return (f"one of tenant {tenant}'s {used.running_jobs} running jobs{sessions} to end (its quota "
                f"max_running_jobs={quota.max_running_jobs})")
    if quota.max_workers is not None and used.workers + workers > quota.max_workers:
        return (f"tenant {tenant}'s jobs{sessions} to free workers ({used.workers} in use, this job needs "
                f"{workers}, its quota max_workers={quota.max_workers})")
    return None


def check_submission(store: Store, quotas: dict[str, TenantQuota], tenant: str, par: ParallelDims) -> None:
    """A job its tenant's quota could never run is a 422; a GPU job of a tenant whose budget is spent a 429."""
    quota = quota_of(quotas, tenant)
    _check_fits(quota, tenant, par, "job")
    if par.gpus_per_worker and quota.gpu_hours is not None:
        _check_budget(quota, usage_by_tenant(store, store.jobs_with_status(*SLOT_STATUSES), time.time())[tenant],
                      tenant, "job")


def check_session(store: Store, quotas: dict[str, TenantQuota], tenant: str, par: ParallelDims,
                  max_running_jobs: int) -> None:
    """As a job's check; and a session, which does not queue, is a 429 while the cluster's running slots (jobs and
    open sessions together) or its tenant's running jobs and sessions leave it no room. Run it, and the session's
    insert, under Store.slots_locked(): two creates at once must not both take the last place."""
    quota = quota_of(quotas, tenant)
    _check_fits(quota, tenant, par, "session")
    holding = store.jobs_with_status(*SLOT_STATUSES)
    usage = usage_by_tenant(store, holding, time.time())
    used = usage[tenant]
    if par.gpus_per_worker and quota.gpu_hours is not None:
        _check_budget(quota, used, tenant, "session")
    sessions = sum(u.sessions for u in usage.values())
    reason = slots_full(len(holding), sessions, max_running_jobs) or _over_limit(quota, used, tenant,
                                                                                 par.num_workers)
    if reason:
        raise APIException(429, ErrorCode.quota_exceeded, f"the training session would have to wait for {reason}; "
                                                          "sessions do not queue: retry once one has ended")


def open_sessions(store: Store) -> int:
    """Training sessions holding a running slot (open), of every tenant."""
    with store._sessions() as s:
        return s.scalar(select(func.count()).where(SessionRow.status.in_(SESSION_HOLDING)))


def slots_full(jobs: int, sessions: int, max_running_jobs: int) -> str | None:
    """Why no running slot is free (max_running_jobs counts jobs holding one and open sessions), or None."""
    if jobs + sessions < max_running_jobs:
        return None
    open_ = f" and {sessions} training sessions open" if sessions else ""
    return f"a running slot ({jobs} jobs running{open_}, max_running_jobs={max_running_jobs})"


def _check_fits(quota: TenantQuota, tenant: str, par: ParallelDims, what: str) -> None:
    if quota.max_workers is not None and par.num_workers > quota.max_workers:
        raise APIException(422, ErrorCode.invalid_request,
                           f"parallelism.num_workers: {par.num_workers} workers exceed tenant {tenant}'s quota "
                           f"max_workers={quota.max_workers}; the {what} could never start",
                           "parallelism.num_workers")


def _check_budget(quota: TenantQuota, used: TenantUsage, tenant: str, what: str) -> None:
    if spent := _budget_spent(quota, used, tenant):
        raise APIException(429, ErrorCode.quota_exceeded, f"{spent}; no GPU {what} can start until an "
                                                          "operator raises tenant_quotas.gpu_hours")
