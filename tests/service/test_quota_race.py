"""Fifty creates at once (training jobs and training sessions of one tenant) against its quota of 3 running jobs, with
the scheduler starting jobs meanwhile: exactly 3 places are taken, on SQLite and on PostgreSQL. The quota check and
the taking of a place are one step under the slots lock (Store.slots_locked)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.support.ray_jobs_api import RayJobsAPI
from bench.support.waiting import wait_for
from moetune.api.models.responses import JobStatus
from moetune.service.quotas import usage_by_tenant

QUOTA = 3
SESSION = {"lora": {"rank": 4}, "parallelism": {"num_workers": 1}}


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_fifty_creates_at_once_take_exactly_the_quota(database, request, start_service, s3_endpoint, inputs):
    ray = RayJobsAPI()
    database_url = {"database_url": request.getfixturevalue("postgres_url")} if database == "postgres" else {}
    service = start_service(s3_endpoint_url=s3_endpoint, ray_address=ray.url, scheduler_enabled=True,
                            scheduler_interval_s=0.05, max_running_jobs=50,
                            tenant_quotas={"tenant-a": {"max_running_jobs": QUOTA}}, **database_url)
    job, session = ("/v1/fine_tuning/jobs", inputs), ("/v1/training_sessions", {"model": inputs["model"], **SESSION})
    try:
        with service.http() as http, ThreadPoolExecutor(50) as pool:
            answers = list(pool.map(lambda create: http.post(create[0], json=create[1]), [job, session] * 25))
        assert {a.status_code for a in answers[::2]} == {200}, answers[0].text  # jobs queue
        sessions = [a.status_code for a in answers[1::2]]
        assert set(sessions) <= {200, 429}, answers[1].text
        store = service.store

        def settled():  # every job validated, and the ones not started say they wait for the quota
            waiting = store.jobs_with_status(JobStatus.validating_files, JobStatus.queued)
            return all(j.status == JobStatus.queued and j.queue_reason and f"max_running_jobs={QUOTA}" in
                       j.queue_reason for j in waiting)

        wait_for(settled, 30, "the scheduler to start what fits and hold the other jobs back", interval=0.1)
        running = store.jobs_with_status(JobStatus.running)
        used = usage_by_tenant(store, running, 0.0)["tenant-a"]
        assert (used.running_jobs, used.sessions, sessions.count(200)) == (QUOTA, QUOTA - len(running), used.sessions)
        assert len(ray.attempts) == QUOTA  # the jobs' and the sessions' Ray submissions
    finally:
        ray.close()
