"""Two control-plane replicas (`moetune server` processes) on one real PostgreSQL: exactly one schedules, the other
takes over a killed or paused leader, and no job is lost or submitted twice. Ray is bench.support.ray_jobs_api's
recording stand-in for the Jobs API, so that every submission attempt is counted (and no Ray job starts)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from bench.support.replicas import LEASE_S, RENEW_S, all_running, replica_set, takeover
from bench.support.waiting import wait_for
from moetune.api.models.responses import JobStatus
from moetune.service.cluster.leader import LeaderLease
from moetune.service.cluster.scheduler import submission_id
from moetune.service.store import SCHEDULER_LEASE, JobRow, Store
from tests.support.control_plane import API_TOKENS, OUTPUT_BUCKET, TOKENS


@pytest.fixture
def replicas(postgres_url, s3_endpoint, output_bucket, tmp_path):
    """Starts replicas sharing one database and one (slow: 0.2 s a submission) Ray Jobs API; stops them all."""
    with replica_set(postgres_url, s3_endpoint, f"s3://{OUTPUT_BUCKET}/runs", API_TOKENS, TOKENS["tenant-a"],
                     tmp_path) as started:
        yield started


def test_a_paused_then_a_killed_leader_is_replaced_and_no_job_is_lost_or_submitted_twice(replicas, inputs):
    start, ray_api = replicas
    a = start()
    wait_for(a.leads, 10, "the first replica to take the scheduler lease", interval=0.1)
    b = start()
    assert not b.leads()
    answers: list = []

    # Pause the leader mid-queue: the standby takes over; the paused one wakes up to find its lease gone.
    first = [b.create_job(inputs) for _ in range(6)]  # through the standby: both serve the API
    paused_takeover_s = takeover(ray_api, a, signal.SIGSTOP, b, first, inputs, answers)
    a.signal(signal.SIGCONT)
    wait_for(lambda: not a.leads(), 5, "the paused leader to find its lease gone", interval=0.1)
    wait_for(lambda: all_running(b, first), 30, "every job to run")

    # Kill the new leader mid-queue: the woken one takes over.
    second = [a.create_job(inputs) for _ in range(6)]
    takeover_s = takeover(ray_api, b, signal.SIGKILL, a, second, inputs, answers)
    jobs = first + second
    wait_for(lambda: all_running(a, jobs), 30, "every job to run")

    submissions = {j: ray_api.submitters(submission_id(j, 1)) for j in jobs}
    lost = [j for j, by in submissions.items() if not by]
    duplicated = {j: by for j, by in submissions.items() if len(by) > 1}
    print(f"RESULT replicas=2 leader_takeover_s={takeover_s:.2f} paused_leader_takeover_s={paused_takeover_s:.2f} "
          f"jobs={len(submissions)} jobs_lost={len(lost)} duplicate_submissions={len(duplicated)} "
          f"requests_during_switch={len(answers)}")
    assert not lost and not duplicated, (lost, duplicated)
    assert len(ray_api.attempts) == len(submissions)  # no refused second attempt either
    # each takeover happened mid-queue: both replicas submitted jobs of each batch
    assert {by[0] for j, by in submissions.items() if j in first} == {a.url, b.url}
    assert {by[0] for j, by in submissions.items() if j in second} == {a.url, b.url}
    assert takeover_s < LEASE_S + RENEW_S + 1.5 and paused_takeover_s < LEASE_S + RENEW_S + 1.5
    assert answers and all(status == 200 or (status == 503 and retry) for status, retry in answers), answers


def test_a_deposed_leaders_writes_are_fenced_out(postgres_url):
    old_store, new_store = Store(postgres_url), Store(postgres_url)
    old_store.migrate()
    old = LeaderLease(old_store, duration_s=0.3, renew_s=0.1)
    new = LeaderLease(new_store, duration_s=30, renew_s=10)
    old.renew()
    first = old.epoch()
    new.renew()
    assert first is not None and new.epoch() is None  # held: the other replica waits
    time.sleep(0.4)  # the old leader pauses past its lease
    assert old.epoch() is None
    new.renew()
    assert new.epoch() == first + 1

    job_id = _queued_job(old_store)
    assert not old_store.update_job(job_id, fence=first, job_token_hash="x")
    assert not old_store.transition(job_id, [JobStatus.queued], JobStatus.running, "Job started", fence=first)
    assert new_store.transition(job_id, [JobStatus.queued], JobStatus.running, "Job started", fence=new.epoch())
    old.renew()  # wakes up: the lease is taken
    assert old.epoch() is None and old_store.acquire_lease(SCHEDULER_LEASE, old.holder, 1) is None
    new.stop()  # hands over at once
    old.renew()
    assert old.epoch() == first + 2
    old_store.close()
    new_store.close()


def test_a_leader_paused_inside_a_fenced_write_does_not_hold_thetakeover(postgres_url):
    """SIGSTOP can land between a fenced write's share lock and its commit (the full suite's paused-leader case hit
    it on a loaded machine): the standby takes the lease once the database ends that idle transaction, and the
    paused leader's write, when it wakes, changes nothing."""
    from sqlalchemy import update
    from sqlalchemy.exc import DBAPIError

    old_store, new_store = Store(postgres_url), Store(postgres_url)
    old_store.migrate()
    old = LeaderLease(old_store, duration_s=0.3, renew_s=0.1)
    old.renew()
    job_id = _queued_job(old_store)
    new = LeaderLease(new_store, duration_s=30, renew_s=10)
    with pytest.raises(DBAPIError, match="idle-in-transaction timeout"), old_store._write() as s:
        assert old_store._fenced(s, old.epoch())  # the share lock is taken; then the leader stops
        time.sleep(0.4)  # past its lease
        renewing = threading.Thread(target=new.renew)  # waits on the lock until the paused transaction ends
        renewing.start()
        renewing.join(10)
        assert not renewing.is_alive() and new.epoch() is not None, "the takeover waited for the paused leader"
        s.execute(update(JobRow).where(JobRow.id == job_id).values(status="running"))  # the woken leader's write
    assert old_store.get_job(job_id, "t").status == "queued"
    old_store.close()
    new_store.close()


def _queued_job(store: Store) -> str:
    job = store.create_job(JobRow(id="ftjob-fenced", tenant="t", status="queued", priority=0, spec={}, seed=1,
                                  output_uri="s3://o/x", result_files=[], progress={}), ["Job queued"])
    return job.id
