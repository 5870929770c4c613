"""Tenant quotas (settings.tenant_quotas): jobs running at once, workers in use, and a GPU-hour budget.

A job that can never fit its tenant's quota is refused at submission (422); a tenant whose budget is spent gets
429 for new GPU jobs; a job that only has to wait for its tenant's own jobs to end stays queued with its reason.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from moetune.api.errors import ErrorCode
from moetune.api.models.job_create import JobCreate
from moetune.service.api_exception import APIException
from moetune.service.store import SLOT_STATUSES, JobRow, Store

ANY_TENANT = "*"  # the quota of every tenant not named


class TenantQuota(BaseModel):
    """Unset: no limit. The Helm chart's camelCase keys (maxRunningJobs, ...) are accepted too."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    max_running_jobs: int | None = Field(None, ge=0)
    max_workers: int | None = Field(None, ge=1)  # workers of its running jobs together (one GPU each on GPU jobs)
    gpu_hours: float | None = Field(None, ge=0)  # GPU-hours its jobs' runs may use in all


@dataclass
class TenantUsage:
    running_jobs: int = 0
    workers: int = 0
    gpu_seconds: float = 0.0

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
    return usage


def _budget_spent(quota: TenantQuota, used: TenantUsage, tenant: str) -> str | None:
    if quota.gpu_hours is not None and used.gpu_hours >= quota.gpu_hours:
        return f"tenant {tenant} has used {used.gpu_hours:.2f} of its {quota.gpu_hours:g} GPU-hour budget"
    return None


def wait_reason(quotas: dict[str, TenantQuota], usage: dict[str, TenantUsage], job: JobRow) -> str | None:
    """Why the job's tenant quota holds it back now, or None."""
    quota, used = quota_of(quotas, job.tenant), usage.get(job.tenant, TenantUsage())
    if job.gpus and (spent := _budget_spent(quota, used, job.tenant)):
        return f"{spent} (tenant_quotas.gpu_hours); the job waits for a larger budget"
    if quota.max_running_jobs is not None and used.running_jobs >= quota.max_running_jobs:
        return (f"waiting for one of tenant {job.tenant}'s {used.running_jobs} running jobs to end (its quota "
                f"max_running_jobs={quota.max_running_jobs})")
    if quota.max_workers is not None and used.workers + _workers(job) > quota.max_workers:
        return (f"waiting for tenant {job.tenant}'s jobs to free workers ({used.workers} in use, this job needs "
                f"{_workers(job)}, its quota max_workers={quota.max_workers})")
    return None


def check_submission(store: Store, quotas: dict[str, TenantQuota], tenant: str, spec: JobCreate) -> None:
    """A job its tenant's quota could never run is a 422; a GPU job of a tenant whose budget is spent a 429."""
    quota = quota_of(quotas, tenant)
    workers = spec.parallelism.num_workers
    if quota.max_workers is not None and workers > quota.max_workers:
        raise APIException(422, ErrorCode.invalid_request,
                           f"parallelism.num_workers: {workers} workers exceed tenant {tenant}'s quota "
                           f"max_workers={quota.max_workers}; the job could never start",
                           "parallelism.num_workers")
    if spec.parallelism.gpus_per_worker and quota.gpu_hours is not None:
        used = usage_by_tenant(store, store.jobs_with_status(*SLOT_STATUSES), time.time())
        if spent := _budget_spent(quota, used[tenant], tenant):
            raise APIException(429, ErrorCode.quota_exceeded, f"{spent}; no GPU job can start until an "
                                                              "operator raises tenant_quotas.gpu_hours")
